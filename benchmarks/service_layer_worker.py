"""A worker process of the service-layer benchmark: a real `WorkerServer` (gRPC server, worker
core, engine host) around a `TokenSourceEngine`, registered with the head's router.

    python -m benchmarks.service_layer_worker --router 127.0.0.1:PORT --worker-id w0 [--pool colocated]

Prints {"worker_id", "address"} once registered, then answers commands on stdin, one JSON line
each: {"cmd": "stats"} -> the engine's request and token counts and its own CPU seconds; {"cmd": "emissions", "path": P}
-> writes the emission times of the requests it held (request id -> [monotonic s per token]) to
P; {"cmd": "configure", "step_period_s": S} -> a new step period. Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.service_layer_pd_source import TokenSourceCompletion, TokenSourcePrompt
from benchmarks.service_layer_procs import commands, prepare_child, reply
from benchmarks.token_source import TokenSourceEngine, token_source_config
from deepinfer_core.roles import EngineType

POOLS = {"colocated": EngineType.NORMAL, "prefill": EngineType.PROMPT, "decode": EngineType.COMPLETION}


_STAND_INS = {EngineType.PROMPT: TokenSourcePrompt, EngineType.COMPLETION: TokenSourceCompletion}
"""The stand-in of each role (NORMAL: `TokenSourceEngine`)."""


def build_engine(args: argparse.Namespace) -> TokenSourceEngine:
    engine_type = POOLS[args.pool]
    config = token_source_config(engine_type, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    kwargs = dict(
        config=config,
        step_period_s=args.step_ms / 1e3,
        tokens_per_step=args.tokens_per_step,
        max_batch=args.max_batch or None,
        name=f"token_source_{args.worker_id}",
    )
    extra = {EngineType.COMPLETION: {"handoff_delay_s": args.handoff_ms / 1e3}}.get(engine_type, {})
    return _STAND_INS.get(engine_type, TokenSourceEngine)(**kwargs, **extra)


def start_server(args: argparse.Namespace, engine: TokenSourceEngine):
    from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL
    from services.workers.spec import WorkerSpec
    from services.workers.worker_server import WorkerServer

    pool = {"colocated": POOL_COLOCATED, "prefill": POOL_PREFILL, "decode": POOL_DECODE}[args.pool]
    spec = WorkerSpec(
        args.worker_id,
        pool,
        router_address=args.router,
        cluster_token=args.cluster_token,
        metrics=False,
        stream_interval=args.stream_interval,
        grpc_server=args.grpc_server,
    )
    server = WorkerServer(spec, engine=engine)
    server.start(timeout_s=60.0)
    from services.common.gc_tuning import freeze_startup_heap

    freeze_startup_heap()  # as a worker's Ray actor does
    return server


def answer(engine: TokenSourceEngine, cmd: dict) -> dict:
    if cmd["cmd"] == "stats":
        return {
            "requests": len(engine.requests),
            "tokens": engine.num_tokens,
            "steps": engine.num_steps,
            "engine_cpu_s": engine.cpu_seconds,
        }
    if cmd["cmd"] == "emissions":
        emissions = engine.take_emissions()
        with open(cmd["path"], "w") as f:
            json.dump(emissions, f)
        return {"requests": len(emissions)}
    if cmd["cmd"] == "configure":
        engine.step_period_s = float(cmd["step_period_s"])  # read once per step by the engine thread
        return {"step_period_s": engine.step_period_s}
    return {"error": f"unknown command {cmd['cmd']!r}"}


def main() -> None:
    prepare_child()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", required=True, help="the head's router address (host:port)")
    parser.add_argument("--cluster-token", default="", help="the head's cluster token (its router asks for it)")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--pool", choices=sorted(POOLS), default="colocated")
    parser.add_argument("--step-ms", type=float, default=20.0, help="engine step period")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="tokens each running request gets per step")
    parser.add_argument("--stream-interval", type=int, default=1, help="tokens between a request's deltas")
    parser.add_argument("--grpc-server", choices=("h2", "grpcio"), default="h2", help="the worker's gRPC server")
    parser.add_argument("--max-batch", type=int, default=0, help="requests advanced per step (0: max-num-seqs)")
    parser.add_argument("--max-num-seqs", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--handoff-ms", type=float, default=5.0, help="decode pool: reserve -> first token")
    args = parser.parse_args()
    engine = build_engine(args)
    try:
        server = start_server(args, engine)
    except Exception as e:
        reply({"error": f"{type(e).__name__}: {e}"})
        raise
    reply({"worker_id": args.worker_id, "address": server.info.address})
    for cmd in commands():
        reply(answer(engine, cmd))
    os._exit(0)  # stdin closed: the benchmark is done with us


if __name__ == "__main__":
    main()
