"""`deepinfer bench serve` and `deepinfer bench sweep`: load tests of OpenAI-compatible servers.

Thin over `services.bench`: flags become typed settings here, the package does the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import shlex
import sys

from services.bench import arguments


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (serve) or serving configurations (sweep)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    _add_serve(bench_sub)
    _add_sweep(bench_sub)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="drive one load against a running server and report its latencies")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host and --port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None, help="the model id to ask for (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    arguments.add_dataset_flags(p)
    arguments.add_load_flags(p)
    arguments.add_metric_flags(p)
    g = p.add_argument_group("result")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=".", help="where --save-result writes (default: .)")
    g.add_argument("--result-filename", default=None, help="file name of the result JSON (implies --save-result)")
    g.add_argument("--label", default="", help="a name for this run, kept in the result")
    g.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="fields added to the result")
    p.set_defaults(func=run_serve)


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="start deepinfer serve per configuration and find each one's goodput")
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--configs",
        default="colocated,1p1d",
        help="e.g. colocated,1p1d,2p1d; XpYd-cond: short prompts prefilled on the decode engine; "
        "XpYd-nostore: no KV store (default: colocated,1p1d)",
    )
    g.add_argument("--request-rates", default="1,2,4,8", help="comma-separated requests/s (default: 1,2,4,8)")
    g.add_argument(
        "--serve-args", default="", help='extra flags for every deepinfer serve, e.g. --serve-args="--num-blocks 512"'
    )
    g.add_argument("--serve-timeout", type=float, default=600.0, help="seconds to wait for each server to be ready")
    g.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet the SLOs")
    g.add_argument("--search-steps", type=int, default=0, help="bisections to place each goodput between rates")
    g.add_argument("--output-dir", default=None, help="report directory (default: bench-sweep-DATE)")
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    arguments.add_dataset_flags(p, num_prompts=100)
    arguments.add_load_flags(p, rate_flag=False)
    arguments.add_metric_flags(p, goodput=("ttft:1000", "tpot:100"))
    p.set_defaults(func=run_sweep)


def _serve_bench(args: argparse.Namespace, base_url: str, model: str, tokenizer: str | None):
    from services.bench.driver import Target
    from services.bench.payload import endpoint_kind
    from services.bench.serve import ServeBench

    selection, slos = arguments.metric_settings(args)
    endpoint_kind(args.endpoint)  # a wrong --endpoint is reported before anything is sent
    target = Target(base_url, model, args.endpoint, getattr(args, "api_key", None), arguments.sampling(args))
    return ServeBench(
        target=target,
        dataset=arguments.dataset_options(args),
        load=arguments.load_settings(args),
        selection=selection,
        slos=slos,
        tokenizer=tokenizer,
        label=getattr(args, "label", ""),
        metadata=arguments.key_values(getattr(args, "metadata", []), "--metadata"),
        save=getattr(args, "save_result", False),
        result_dir=getattr(args, "result_dir", "."),
        result_filename=getattr(args, "result_filename", None),
    )


def run_serve(args: argparse.Namespace) -> int:
    from services.bench import serve
    from services.bench.models import first_model

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if args.model is None:
        try:
            args.model = first_model(base_url, args.api_key)
        except ValueError as e:
            print(f"deepinfer bench: error: {e}", file=sys.stderr)
            return serve.EXIT_FAILED
    try:
        return serve.run(_serve_bench(args, base_url, args.model, args.tokenizer))
    except KeyboardInterrupt:
        return serve.EXIT_INTERRUPTED


def run_sweep(args: argparse.Namespace) -> int:
    from services.bench.metrics import METRICS, Selection
    from services.bench.sweep import runner
    from services.bench.sweep.configs import parse_configs
    from services.bench.sweep.report import write_report

    serve_args = shlex.split(args.serve_args)
    bench = _serve_bench(args, "", "", args.tokenizer or _model_dir(serve_args))
    # the report shows every latency metric, whatever --percentile-metrics says
    bench = dataclasses.replace(bench, selection=Selection(METRICS, bench.selection.percentiles))
    plan = runner.SweepPlan(
        configs=parse_configs(args.configs),
        rates=_rates(args.request_rates),
        bench=bench,
        output_dir=args.output_dir or datetime.datetime.now().strftime("bench-sweep-%Y%m%d-%H%M%S"),
        serve_args=serve_args,
        attainment=args.attainment,
        search_steps=args.search_steps,
        serve_timeout_s=args.serve_timeout,
    )
    if not {"ttft", "tpot"} <= plan.bench.slos.keys() or not 0 < plan.attainment <= 1:
        raise ValueError("a sweep needs --goodput ttft:MS tpot:MS and --attainment in (0, 1]")
    sweeps = runner.run_sweep(plan)
    paths = write_report(plan, sweeps)
    print(f"deepinfer bench: report in {plan.output_dir}: {', '.join(p.rsplit('/', 1)[-1] for p in paths)}")
    if any(s.error == runner.INTERRUPTED for s in sweeps):
        return 130
    failed = 0
    for s in sweeps:
        reason = s.error or next((p.result["aborted"] for p in s.points if p.result.get("aborted")), "")
        if reason:
            print(f"deepinfer bench: error: configuration {s.config.name}: {reason}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--request-rates {text!r}: expected numbers, e.g. 1,2,4") from None
    if not rates or rates[0] <= 0 or math.isinf(rates[-1]):
        raise ValueError(f"--request-rates {text!r}: each rate must be a positive, finite number")
    return rates


def _model_dir(serve_args: list[str]) -> str | None:
    """The tokenizer of the model the sweep serves: its --model directory, else the embedded model's."""
    from deepinfer_core.builtin import TINY_MODEL_DIR

    for i, arg in enumerate(serve_args):
        if arg == "--model" and i + 1 < len(serve_args):
            return serve_args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return TINY_MODEL_DIR
