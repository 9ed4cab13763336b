"""Service-layer throughput: what the head (gateway + router) and the workers' service layer
cost per streamed output token, with an engine that costs nothing.

Every output token travels engine -> worker gRPC stream -> router -> gateway -> client (SSE or
gRPC). This benchmark runs that path with real processes on 127.0.0.1 and a stand-in engine:

- one head process: router + gateway servers on one asyncio loop (`Head.start_front`, no Ray);
- N worker processes, each a real `WorkerServer` around a `TokenSourceEngine`
  (`token_source.py`: no compute; each step of `--step-ms` gives every running request
  `--tokens-per-step` tokens), registered with the router like any worker;
- client processes, apart from the head so that their CPU is not counted there, each holding
  its share of the streams open: back-to-back completions of `--max-tokens` tokens over SSE
  (a lean asyncio HTTP client) or `deepinfer.v1.Gateway/Generate`.
With `--pd` the workers are decode and prefill pairs (`service_layer_pd_source.py`: a hand-off
with no KV); the first token then comes from the prefill worker and is left out of the latency.

For each protocol and each stream count, once the ramp (the head admitting every stream) is over
and a warm-up has passed, it reports over a steady-state window:
- tokens/s offered (streams x tokens per step / step period), emitted by the token sources and
  delivered to the clients, and the tokens per engine step (the batch each step hands the
  service layer). A level delivering under 90% of the offered rate is saturated ("sat."): the
  sources finish requests whose tokens still wait in the services' queues, so they hold fewer
  streams than the clients keep open, and the latency is queueing behind the bottleneck;
- added latency per token, p50/p99: the client's receive time minus the monotonic time the
  engine step that emitted the token ended, joined token by token through the emission log each
  token source keeps (one machine, one CLOCK_MONOTONIC); it includes the client's reading;
- CPU µs per delivered token of the head, of each worker (the whole process, and its service
  layer: the process less the token source's own CPU, which the source measures on its thread)
  and of the clients, from /proc over the window (user + system), and the head's share of a core;
- the check: every delivered token is the one its source emitted at that position, in order,
  none lost or doubled, finished requests complete; requests the services failed are counted.
Then the per-request overhead: non-streamed requests one at a time through the services against
the same token source driven in-process. Prints tables and the ratios to the targets (head
<= 20 µs, a worker's service layer <= 10 µs per token); `--json FILE` writes every number. Exits
1 when a token was wrong or a request failed. The machine is shared with whatever else runs:
CPU per token is the robust number; rates and latencies move with the load around it.

    python -m benchmarks.service_layer [--streams 1,16,64,256,1024] [--protocols sse,grpc] [--workers 1]
                                       [--step-ms 20] [--window-s 3] [--pd] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import service_layer_report as report  # noqa: E402
from benchmarks.service_layer_cluster import Cluster, LoadOptions, run_level  # noqa: E402
from benchmarks.service_layer_head import PROFILE_HEAD_ENV  # noqa: E402
from benchmarks.service_layer_overhead import measure_overhead  # noqa: E402
from benchmarks.service_layer_procs import Children  # noqa: E402
from services import native  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,16,64,256,1024", help="comma-separated concurrent stream counts")
    p.add_argument("--protocols", default="sse,grpc", help="sse, grpc or both")
    p.add_argument("--workers", type=int, default=1, help="token-source worker processes")
    p.add_argument("--clients", type=int, default=2, help="client processes per level")
    p.add_argument(
        "--api-workers", type=int, default=1, help="API processes of the head (deepinfer serve --api-workers)"
    )
    p.add_argument("--step-ms", type=float, default=20.0, help="token source step period")
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--stream-interval", type=int, default=1, help="the workers' tokens between a request's deltas")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--window-s", type=float, default=3.0, help="steady-state measurement window per level")
    p.add_argument("--overhead-requests", type=int, default=20)
    p.add_argument("--overhead-step-ms", type=float, default=0.0, help="token source step period for the overhead")
    p.add_argument("--pd", action="store_true", help="prefill + decode pools (token-source hand-off) instead")
    p.add_argument(
        "--python-lane",
        action="store_true",
        help="the head without the fast lane's compiled half (DEEPINFER_NATIVE_LANE=0), as where it is not built",
    )
    p.add_argument(
        "--grpc-server",
        choices=("h2", "grpcio"),
        default="h2",
        help="the gateway's and the workers' gRPC servers (deepinfer serve --grpc-server)",
    )
    p.add_argument("--quick", action="store_true", help="short windows and few requests (tests)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument(
        "--profile-head", default=None, help="run the head under cProfile and write its stats here (slows it down)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.warmup_s, args.window_s = min(args.warmup_s, 0.5), min(args.window_s, 1.0)
        args.overhead_requests = min(args.overhead_requests, 5)
    return args


def run(args: argparse.Namespace) -> dict:
    streams = [int(s) for s in args.streams.split(",") if s]
    protocols = [p for p in args.protocols.split(",") if p]
    options = LoadOptions(
        step_ms=args.step_ms,
        tokens_per_step=args.tokens_per_step,
        stream_interval=args.stream_interval,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
        clients=args.clients,
        pd=args.pd,
        api_workers=args.api_workers,
        grpc_server=args.grpc_server,
    )
    if args.profile_head:
        os.environ[PROFILE_HEAD_ENV] = os.path.abspath(args.profile_head)
    with tempfile.TemporaryDirectory(prefix="service-layer-") as tmp:
        children = Children(tmp)
        try:
            cluster = Cluster(children, args.workers, options, max_concurrent=max(streams) * 2 + 64)
            idle = cluster.idle_utilisation(args.warmup_s)
            levels = []
            for protocol in protocols:
                for s in streams:
                    levels.append(run_level(cluster, protocol, s, tmp))
                    print(f"  {protocol} {s} streams: {levels[-1]['delivered_tokens_per_s']:.0f} tok/s", flush=True)
            overhead = None
            if args.overhead_requests > 0 and not args.pd:
                overhead = measure_overhead(
                    cluster, args.max_tokens, args.prompt_len, args.overhead_requests, args.overhead_step_ms / 1e3
                )
        finally:
            children.stop_all()
    return {
        "config": vars(args),
        "idle_utilisation": idle,
        "levels": levels,
        "overhead": overhead,
        "ratios": report.ratios(levels),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.python_lane:
        os.environ["DEEPINFER_NATIVE_LANE"] = "0"  # the head's process inherits it
    lane = "python" if args.python_lane or native.delta_lane is None else "native"
    results = run(args)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = "prefill + decode" if args.pd else "colocated"
    print(
        f"\nService layer, token source ({mode}, {args.workers} worker(s), {args.api_workers} API process(es), "
        f"step {args.step_ms:g} ms, "
        f"{args.tokens_per_step} token(s)/step, {args.max_tokens} tokens/request, "
        f"stream interval {args.stream_interval}, {lane} lane, gRPC server {args.grpc_server}), "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {when}; window {args.window_s:g} s after {args.warmup_s:g} s\n"
    )
    print("\n".join(report.level_table(results["levels"])))
    print(report.idle_line(results["idle_utilisation"]))
    problems = report.problem_lines(results["levels"])
    if problems:
        print("Mismatches and failed requests:\n" + "\n".join(problems))
    if results["overhead"] is not None:
        print()
        print("\n".join(report.overhead_table(results["overhead"])))
    print()
    print("\n".join(report.ratio_lines(results["ratios"])))
    if args.json:
        results["when"], results["lane"] = when, lane
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    problems = sum(lv["check"]["mismatches"] + lv["check"]["errors"] for lv in results["levels"])
    return 1 if problems or (results["overhead"] and not results["overhead"]["text_exact"]) else 0


if __name__ == "__main__":
    sys.exit(main())
