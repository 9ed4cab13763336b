"""The head process of the service-layer benchmark: the router and the gateway (HTTP + gRPC) on
one asyncio loop, as `deepinfer serve` runs them, without Ray and without workers of its own
(`Head.start_front`); token-source workers register at the router address it prints.

    python -m benchmarks.service_layer_head [--pd] [--max-concurrent-requests 4096] [--api-workers N] [--grpc-server h2]

Prints one JSON line ({"http_url", "grpc_address", "router_address", "api_pids", "cluster_token", "pid"})
once serving, then serves until its stdin closes. With `--api-workers N` the head starts N - 1 more API
processes on the same ports, as `deepinfer serve --api-workers N` does; `api_pids` are theirs; its
workers register with `cluster_token`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from benchmarks.service_layer_procs import prepare_child, reply


def head_config(args: argparse.Namespace):
    from services.controller.serve_config import HeadConfig
    from services.workers.spec import EngineSettings

    return HeadConfig(
        host="127.0.0.1",
        port=0,
        grpc_port=0,
        colocated=not args.pd,
        engine_args=EngineSettings(max_model_len=args.max_model_len),
        max_concurrent_requests=args.max_concurrent_requests,
        api_workers=args.api_workers,
        grpc_server=args.grpc_server,
        log_level="WARNING",
    )


async def serve(args: argparse.Namespace) -> None:
    from services.controller.head import Head

    head = Head(head_config(args))
    await head.start_front()
    api_pids = [pid for i, pid in sorted(head.api_workers.pids.items()) if i] if head.api_workers else []
    reply(
        {
            "http_url": head.http_url,
            "grpc_address": head.grpc_address,
            "router_address": head.router_address,
            "api_pids": api_pids,
            "cluster_token": head.config.cluster_token,
        }
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin


PROFILE_HEAD_ENV = "DEEPINFER_BENCH_PROFILE_HEAD"
"""A path: the head runs under cProfile and writes its stats there when it stops (`--profile-head`)."""


def _profiler():
    if not os.environ.get(PROFILE_HEAD_ENV):
        return None
    import cProfile

    profile = cProfile.Profile()  # wall time: CPU-time timers cost a system call per event here
    profile.enable()
    return profile


def main() -> None:
    prepare_child()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pd", action="store_true", help="prefill and decode pools instead of the colocated one")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-concurrent-requests", type=int, default=4096)
    parser.add_argument("--api-workers", type=int, default=1, help="API processes on the same ports")
    parser.add_argument("--grpc-server", choices=("h2", "grpcio"), default="h2", help="the gateway's gRPC server")
    args = parser.parse_args()
    from services.metrics.multiprocess import shared_metrics

    with shared_metrics(enabled=args.api_workers > 1):  # before prometheus-client is imported
        from services.common.grpc_util import install_uvloop

        install_uvloop()
        profile = _profiler()
        try:
            asyncio.run(serve(args))
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            if profile is not None:
                profile.disable()
                profile.dump_stats(os.environ[PROFILE_HEAD_ENV])
    os._exit(0)  # the servers need no orderly stop: the process ends with the benchmark level


if __name__ == "__main__":
    main()
