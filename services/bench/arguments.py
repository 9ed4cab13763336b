"""The command-line flags of `deepinfer bench`, named as `vllm bench serve` names them, and their
translation into the typed settings of a run."""

from __future__ import annotations

import argparse
import json
import math

from services.bench.datasets import DATASETS, DatasetOptions
from services.bench.driver import Load
from services.bench.metrics import METRICS, Selection, parse_selection, parse_slos
from services.bench.payload import Sampling


def add_dataset_flags(p: argparse.ArgumentParser, num_prompts: int = 1000) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS, help="(default: random)")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT-format JSON file (--dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests to send (default: {num_prompts})")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory, for exact prompt lengths")
    g.add_argument(
        "--prompt-format", default="text", choices=("text", "token-ids"), help="random prompts as text or token ids"
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in [len*(1-r), len*(1+r)]")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="max_tokens of every ShareGPT request")
    g.add_argument("--shared-prefix-num-groups", type=int, default=8)
    g.add_argument("--shared-prefix-prompts-per-group", type=int, default=16)
    g.add_argument("--shared-prefix-len", type=int, default=512, help="tokens each group's prompts share")
    g.add_argument("--shared-prefix-suffix-len", type=int, default=128, help="tokens after the shared prefix")
    g.add_argument("--random-mm-base-items-per-request", type=int, default=1, help="images per request (random-mm)")
    g.add_argument("--random-mm-image-size", default="64x64", help="WIDTHxHEIGHT of each image (default: 64x64)")


def add_load_flags(p: argparse.ArgumentParser, rate_flag: bool = True) -> None:
    """`rate_flag`: offer --request-rate (a sweep has its list of rates instead)."""
    g = p.add_argument_group("load")
    if rate_flag:
        g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: inf, all at once)")
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 = Poisson, inf = a constant rate"
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent before the measured run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for a response's next byte")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (vLLM's extension)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")


def add_metric_flags(p: argparse.ArgumentParser, goodput: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=list(goodput),
        metavar="NAME:MS",
        help="SLOs a request must all meet to count as good: ttft:MS tpot:MS e2el:MS"
        + (f" (default: {' '.join(goodput)})" if goodput else ""),
    )
    g.add_argument("--percentile-metrics", default=",".join(METRICS), help="(default: ttft,tpot,itl,e2el)")
    g.add_argument("--metric-percentiles", default="90,95,99", help="(default: 90,95,99)")


def dataset_options(args: argparse.Namespace) -> DatasetOptions:
    width, sep, height = args.random_mm_image_size.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit()):
        raise ValueError(f"--random-mm-image-size {args.random_mm_image_size!r}: expected WIDTHxHEIGHT, e.g. 64x64")
    return DatasetOptions(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        seed=args.seed,
        path=args.dataset_path,
        token_ids=args.prompt_format == "token-ids",
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        sharegpt_output_len=args.sharegpt_output_len,
        shared_prefix_num_groups=args.shared_prefix_num_groups,
        shared_prefix_prompts_per_group=args.shared_prefix_prompts_per_group,
        shared_prefix_len=args.shared_prefix_len,
        shared_prefix_suffix_len=args.shared_prefix_suffix_len,
        random_mm_base_items_per_request=args.random_mm_base_items_per_request,
        random_mm_image_size=(int(width), int(height)),
    )


def load_settings(args: argparse.Namespace, request_rate: float | None = None) -> Load:
    """The load of --request-rate, or of `request_rate` when given."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    return Load(
        request_rate=getattr(args, "request_rate", math.inf) if request_rate is None else request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
    )


def sampling(args: argparse.Namespace) -> Sampling:
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    return Sampling(args.temperature, args.top_p, args.top_k, args.ignore_eos, extra)


def metric_settings(args: argparse.Namespace) -> tuple[Selection, dict[str, float]]:
    """(Selection, SLOs) from --percentile-metrics, --metric-percentiles and --goodput."""
    return parse_selection(args.percentile_metrics, args.metric_percentiles), parse_slos(args.goodput)


def key_values(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs[key] = value
    return pairs
