"""`deepinfer bench serve` against an outside instrument (guidellm) on the same server and load.

Both instruments send the same shape of load — fixed concurrency, random prompts of
`--input-len` tokens, `--output-len` output tokens with EOS ignored, streamed `/v1/completions` —
to one server, one instrument at a time, alternating which goes first each round so that a drift
of the machine's load weighs on both. Compared: TTFT p50 and output throughput (tokens/s), each
as deepinfer / guidellm with the 10% band; the last line takes the median of the rounds. Beside
them, the server's own mean TTFT over each instrument's run (its `/metrics` histogram, arrival at
the gateway to the first token): a gap that shows there is in the load the two sent, not in how
they time it. `--request-rate R` sends R requests/s from both instead of a fixed concurrency, so
that the load does not depend on how soon an instrument follows one request's end with the next
request: `--arrivals constant` (default) evenly spaced, `poisson` as Poisson arrivals. guidellm
0.8.1's Poisson profile sends faster than its rate (its worker processes each draw the same
gaps: 12.3 requests/s asked for 8 here), so only the constant one offers both the same load.

guidellm lives in its own environment (it pins other versions of torch and transformers), named
by `--guidellm`: e.g. `python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install
torch==2.13.0 guidellm`.

    python -m benchmarks.bench_agreement --guidellm /tmp/guidellm-venv/bin/guidellm          # starts 1P1D
    python -m benchmarks.bench_agreement --base-url http://127.0.0.1:8000 --model NAME --guidellm ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer_core.builtin import TINY_MODEL_DIR, TINY_MODEL_NAME  # noqa: E402
from services.bench.sweep.configs import parse_config  # noqa: E402
from services.bench.sweep.launcher import LaunchedServer  # noqa: E402

BAND = 0.10
"""Agreement wanted: each figure within 10% of guidellm's."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable (its own venv)")
    p.add_argument("--base-url", default=None, help="a running server; default: start `deepinfer serve` (--config)")
    p.add_argument("--model", default=TINY_MODEL_NAME)
    p.add_argument("--tokenizer", default=TINY_MODEL_DIR, help="the served model's tokenizer, for both instruments")
    p.add_argument(
        "--config", default="1p1d", help="the configuration to start without --base-url (bench sweep's names)"
    )
    p.add_argument("--serve-args", default="--num-blocks 2048 --block-size 16 --max-model-len 1024")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s, Poisson arrivals, for both instruments instead of --concurrency: the load then "
        "does not depend on how soon each instrument sends a slot's next request after the last one ended",
    )
    p.add_argument(
        "--arrivals",
        choices=("constant", "poisson"),
        default="constant",
        help="with --request-rate: evenly spaced arrivals (guidellm's `constant`, our --burstiness inf) or Poisson",
    )
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument(
        "--server-cpus",
        type=_cpus,
        default=None,
        help="CPUs of the started server's processes, e.g. 0 or 0-7 (with --client-cpus: the instruments "
        "then never share cores with the server they measure)",
    )
    p.add_argument("--client-cpus", type=_cpus, default=None, help="CPUs of both instruments' processes, e.g. 1")
    return p.parse_args(argv)


def _cpus(text: str) -> set[int]:
    """'0', '0-3' or '0,2,4-5' as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_deepinfer(args, url: str, out_dir: str, tag: str) -> dict[str, float]:
    name = f"deepinfer-{tag}.json"
    cmd = [sys.executable, "-m", "services.cli.main", "bench", "serve", "--base-url", url, "--model", args.model]
    cmd += ["--tokenizer", args.tokenizer]
    if args.request_rate:
        burstiness = "inf" if args.arrivals == "constant" else "1.0"
        cmd += ["--request-rate", str(args.request_rate), "--burstiness", burstiness, "--seed", tag]
    else:
        cmd += ["--max-concurrency", str(args.concurrency)]
    cmd += ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--ignore-eos", "--num-warmups", "2"]
    cmd += ["--result-dir", out_dir, "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
    with open(os.path.join(out_dir, name)) as f:
        r = json.load(f)
    return {
        "ttft_p50_ms": r["median_ttft_ms"],
        "output_tok_s": r["output_throughput"],
        "prompt_tokens": r["total_input_tokens"] / max(r["completed"], 1),
        "e2el_p50_ms": r["median_e2el_ms"],
        "failed": r["failed"],
    }


def run_guidellm(args, url: str, out_dir: str, tag: str) -> dict[str, float]:
    path = os.path.join(out_dir, f"guidellm-{tag}.json")
    backend = f"kind=openai_http,target={url},model={args.model},request_format=/v1/completions,validate_backend=false"
    data = f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}"
    if args.request_rate:
        profile = f"kind={args.arrivals},rate={args.request_rate}"
    else:
        profile = f"kind=concurrent,streams={args.concurrency}"
    cmd = [args.guidellm, "run", "--backend", backend, "--profile", profile]
    cmd += ["--data", data, "--tokenizer", f"kind=hf_auto,model={args.tokenizer}"]
    cmd += ["--constraint", f"kind=max_requests,count={args.num_prompts}", "--output", f"kind=json,path={path}"]
    cmd += ["--disable-console"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900, cwd=out_dir)
    with open(path) as f:
        bench = json.load(f)["benchmarks"][0]
    done = bench["requests"]["successful"]
    # the same definitions as `deepinfer bench serve` (and vLLM's): output tokens over the span from
    # the first request's start to the last one's end, and the median of the requests' TTFTs (its own
    # summary's rate is a mean over time buckets, which weighs the ramp-up and tail differently)
    span = max(r["request_end_time"] for r in done) - min(r["request_start_time"] for r in done)
    return {
        "ttft_p50_ms": statistics.median(r["time_to_first_token_ms"] for r in done),
        "output_tok_s": sum(r["output_tokens"] for r in done) / span,
        "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in done),
        "e2el_p50_ms": statistics.median(r["request_latency"] for r in done) * 1e3,
        "gap_ms": None if args.request_rate else _mean_gap_ms(done, args.concurrency),
        "guidellm_summary_tok_s": bench["metrics"]["output_tokens_per_second"]["successful"]["mean"],
        "failed": bench["metrics"]["request_totals"]["errored"],
    }


def _mean_gap_ms(done: list[dict], concurrency: int) -> float:
    """Mean idle time of a concurrency slot per request: the slots' time over the span, less the
    requests' own time (what the instrument itself waits between one request's end and the next's start)."""
    span = max(r["request_end_time"] for r in done) - min(r["request_start_time"] for r in done)
    busy = sum(r["request_end_time"] - r["request_start_time"] for r in done)
    return max(0.0, concurrency * span - busy) / len(done) * 1e3


_SERVER_TTFT = "deepinfer:time_to_first_token_seconds"


def server_ttft(url: str) -> tuple[float, float]:
    """(sum in s, count) of the server's own TTFT histogram (arrival at the gateway to the first
    token), summed over its series: what the server saw, whichever instrument sent the load."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(_SERVER_TTFT + "_sum"):
            total += float(value)
        elif name.startswith(_SERVER_TTFT + "_count"):
            count += float(value)
    return total, count


def _measured(run, args, url: str, out_dir: str, tag: str) -> dict[str, float]:
    """One instrument's run, with the server's mean TTFT over it (the instrument's warm-up included)."""
    before = server_ttft(url)
    got = run(args, url, out_dir, tag)
    after = server_ttft(url)
    n = after[1] - before[1]
    got["server_ttft_mean_ms"] = (after[0] - before[0]) / n * 1e3 if n else float("nan")
    return got


def rounds(args, url: str, out_dir: str) -> list[dict]:
    rows = []
    for i in range(args.rounds):
        order = ("deepinfer", "guidellm") if i % 2 == 0 else ("guidellm", "deepinfer")
        got = {}
        for who in order:
            got[who] = _measured(run_deepinfer if who == "deepinfer" else run_guidellm, args, url, out_dir, str(i))
        rows.append({"round": i + 1, "first": order[0], **got})
        print(f"  round {i + 1}: {_row(rows[-1])}", flush=True)
    return rows


def _ratios(d: dict, g: dict) -> tuple[float, float]:
    return d["ttft_p50_ms"] / g["ttft_p50_ms"], d["output_tok_s"] / g["output_tok_s"]


def _row(r: dict) -> str:
    d, g = r["deepinfer"], r["guidellm"]
    ttft, tput = _ratios(d, g)
    return (
        f"| {r['round']} | {r['first']} | {d['ttft_p50_ms']:.1f} / {g['ttft_p50_ms']:.1f} | {ttft:.2f} | "
        f"{d['output_tok_s']:.1f} / {g['output_tok_s']:.1f} | {tput:.2f} | "
        f"{d['e2el_p50_ms']:.1f} / {g['e2el_p50_ms']:.1f} | {d['e2el_p50_ms'] / g['e2el_p50_ms']:.2f} | "
        f"{d['server_ttft_mean_ms']:.1f} / {g['server_ttft_mean_ms']:.1f} | "
        f"{'-' if g['gap_ms'] is None else format(g['gap_ms'], '.1f')} | {d['prompt_tokens']:.0f} / {g['prompt_tokens']:.0f} | {d['failed']} / {g['failed']} |"
    )


def summary(rows: list[dict]) -> dict[str, float]:
    ttft = statistics.median(_ratios(r["deepinfer"], r["guidellm"])[0] for r in rows)
    tput = statistics.median(_ratios(r["deepinfer"], r["guidellm"])[1] for r in rows)
    e2e = statistics.median(r["deepinfer"]["e2el_p50_ms"] / r["guidellm"]["e2el_p50_ms"] for r in rows)
    agree = abs(ttft - 1) <= BAND and abs(tput - 1) <= BAND
    return {"ttft_ratio": ttft, "throughput_ratio": tput, "e2el_ratio": e2e, "agree": agree}


def _load(args) -> str:
    return (
        f"{args.arrivals} arrivals at {args.request_rate:g} req/s"
        if args.request_rate
        else f"concurrency {args.concurrency}"
    )


def _show(cpus: Optional[set[int]]) -> str:
    return ",".join(map(str, sorted(cpus))) if cpus else "all"


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as out_dir:
        server: Optional[LaunchedServer] = None
        url = args.base_url
        everywhere = os.sched_getaffinity(0)
        if url is None:
            if args.server_cpus:  # the server's processes (Ray's included) inherit this
                os.sched_setaffinity(0, args.server_cpus)
            server = LaunchedServer(
                parse_config(args.config), args.serve_args.split(), os.path.join(out_dir, "serve.log")
            )
            url = server.wait_ready(600)
        os.sched_setaffinity(0, args.client_cpus or everywhere)  # the instruments' processes inherit this
        try:
            rows = rounds(args, url.rstrip("/"), out_dir)
        finally:
            if server is not None:
                server.stop()
    result = summary(rows)
    print(
        f"\n`deepinfer bench serve` vs guidellm: {_load(args)}, {args.num_prompts} requests of "
        f"{args.input_len} -> {args.output_len} tokens, {url}; server CPUs {_show(args.server_cpus)}, "
        f"client CPUs {_show(args.client_cpus)}\n"
    )
    print(
        "| round | first | TTFT p50 deepinfer / guidellm (ms) | ratio | output tok/s deepinfer / guidellm | ratio "
        "| E2E p50 deepinfer / guidellm (ms) | ratio | server's own TTFT mean under deepinfer / guidellm (ms) "
        "| guidellm's idle per request (ms) | prompt tokens | failed |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(_row(r) for r in rows))
    verdict = "within" if result["agree"] else "NOT within"
    print(
        f"\nmedian ratios: TTFT p50 {result['ttft_ratio']:.2f}, output throughput {result['throughput_ratio']:.2f}, "
        f"E2E p50 {result['e2el_ratio']:.2f} "
        f"({verdict} {BAND:.0%})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": vars(args), "rounds": rows, "summary": result}, f, indent=1, default=sorted
            )  # CPU sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
