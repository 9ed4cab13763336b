"""CPU the head process spends per streamed token, stage by stage, in one process.

    python -m benchmarks.gateway_path [--streams 1024] [--tokens 64] [--shapes completions,chat]
                                      [--tokens-per-turn 1] [--http h11|httptools] [--profile http]

Drives the real `RouterCore`, `GatewayCore`, the SSE event streams, the FastAPI app behind
uvicorn's HTTP/1.1 protocol (over a transport that only counts bytes) and the gRPC
`Gateway.Generate` servicer, over `TurnSource` (a worker client fed once per engine turn, see
`gateway_path_parts.py`). Each level runs M concurrent streams of N tokens on its own and is
timed with `time.process_time` (the fastest of `--repeat` runs); a stage's cost is its level minus
the level below it:

    source     the turn loop and its queues alone (the floor, not the head's)
    router     + RouterCore.generate: the sample flow, the assembler, the merge of samples
    gateway    + GatewayCore.generate: the merge of prompts, the choices
    sse        + the SSE event stream: chunk building, JSON, framing
    http       + FastAPI / Starlette / uvicorn: the ASGI send and the HTTP/1.1 chunked body; with
               httptools, mid-stream tokens take the fast lane (`services/gateway/sse_lane.py`)
               and skip the levels above, so a stage's difference can be below zero
    grpc       gateway + the gRPC servicer: response messages, serialized as grpc.aio would

`--profile LEVEL` runs that level once more under cProfile and splits its time by where it is
spent (router loop, gateway merge, chunk building, JSON, SSE framing, HTTP server, event loop),
scaled to the un-profiled µs per token.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: its sibling modules import as `benchmarks.X` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gateway_path_parts import CountingTransport, FakeGrpcContext, TurnSource, http_request  # noqa: E402

LEVELS = ("source", "router", "gateway", "sse", "http", "grpc")


@dataclass(frozen=True)
class Shape:
    name: str
    chat: bool = False
    n: int = 1
    prompts: int = 1
    logprobs: bool = False
    include_usage: bool = False


SHAPES = {
    s.name: s
    for s in (
        Shape("completions"),
        Shape("chat", chat=True),
        Shape("completions-logprobs", logprobs=True),
        Shape("chat-n4", chat=True, n=4),
        Shape("completions-2prompts", prompts=2, include_usage=True),
    )
}


class Bench:
    """One head (router + gateway + app) over one TurnSource."""

    def __init__(self, tokens_per_turn: int, http: str):
        self.source = TurnSource(tokens_per_turn)
        self.http = http

    async def start(self) -> None:
        import uvicorn

        from deepinfer_core.builtin import TINY_MODEL_DIR
        from deepinfer_core.tokenizer import load_tokenizer
        from services.common.limits import RequestLimits
        from services.common.workers import POOL_COLOCATED
        from services.gateway.core import GatewayConfig, GatewayCore
        from services.gateway.grpc_service import GatewayService
        from services.gateway.http_app import build_app
        from services.gateway.router_client import LocalRouterClient
        from services.router.config import RouterConfig
        from services.router.core import RouterCore
        from services.router.registry import PoolRegistry

        registry = PoolRegistry(lambda info: self.source)
        await registry.add(self.source.info(), self.source)
        limits = RequestLimits(max_n=16)
        self.router = RouterCore(registry, RouterConfig(limits=limits, pools=(POOL_COLOCATED,)), "bench")
        config = GatewayConfig("bench", 1 << 16, limits=limits, max_concurrent_requests=1 << 20)
        self.gateway = GatewayCore(config, load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(self.router))
        self.grpc = GatewayService(self.gateway)
        self.uvicorn = uvicorn.Config(build_app(self.gateway), lifespan="off", log_level="warning", http=self.http)
        self.uvicorn.load()

    # ---- one stream of each level ----------------------------------------------------------------
    def params(self, shape: Shape, tokens: int):
        from deepinfer_core.sampling_params import SamplingParams

        return SamplingParams(n=shape.n, max_tokens=tokens, logprobs=2 if shape.logprobs else None)

    async def one(self, level: str, i: int, shape: Shape, tokens: int) -> int:
        """Run request i at `level`; returns how many items its consumers read."""
        prompts = [[(i + p) % 256, 1, 2, 3] for p in range(shape.prompts)]
        params = self.params(shape, tokens)
        rid = f"r{i}"
        if level == "source":  # what the router would open: one stream per prompt and sample
            one = params.clone()
            one.n = 1
            pairs = [(p, ids, s) for p, ids in enumerate(prompts) for s in range(shape.n)]
            readers = [self.source.generate(f"{rid}-{p}/{s}", ids, one, 0) for p, ids, s in pairs]
        elif level == "router":
            readers = [self.router.generate(f"{rid}-{p}", ids, params) for p, ids in enumerate(prompts)]
        elif level == "gateway":
            readers = [self.gateway.generate(prompts, params, rid)]
        elif level == "sse":
            readers = [event_stream(self.gateway, rid, prompts, params, shape)]
        elif level == "grpc":
            return await self._grpc(rid, prompts[0], shape, tokens)
        else:
            return await self._http(i, prompts, shape, tokens)
        return sum(await asyncio.gather(*(_drain(r) for r in readers)))

    async def _grpc(self, rid: str, prompt: list[int], shape: Shape, tokens: int) -> int:
        from deepinfer_proto import gateway_pb2

        request = gateway_pb2.GenerateRequest(model="bench", request_id=rid, token_ids=gateway_pb2.TokenIds(ids=prompt))
        request.params.max_tokens = tokens
        request.params.n = shape.n
        size = 0
        async for msg in self.grpc.Generate(request, FakeGrpcContext()):
            size += len(msg) if msg.__class__ is bytes else len(msg.SerializeToString())
        return size

    async def _http(self, i: int, prompts: list[list[int]], shape: Shape, tokens: int) -> int:
        from uvicorn.server import ServerState

        body = {"model": "bench", "max_tokens": tokens, "n": shape.n, "stream": True}
        if shape.include_usage:
            body["stream_options"] = {"include_usage": True}
        if shape.chat:
            body["messages"] = [{"role": "user", "content": f"hello {i}"}]
            body["logprobs"] = shape.logprobs
            if shape.logprobs:
                body["top_logprobs"] = 2
        else:
            body["prompt"] = prompts if shape.prompts > 1 else prompts[0]
            body["logprobs"] = 2 if shape.logprobs else None
        state = ServerState()
        protocol = self.uvicorn.http_protocol_class(config=self.uvicorn, server_state=state, app_state={})
        transport = CountingTransport(10000 + i, keep=i == 0)
        protocol.connection_made(transport)
        path = "/v1/chat/completions" if shape.chat else "/v1/completions"
        protocol.data_received(http_request(path, json.dumps(body).encode()))
        await asyncio.gather(*state.tasks)
        protocol.connection_lost(None)
        if transport.kept is not None:
            self.sample_body = b"".join(transport.kept)
        return transport.writes

    # ---- a whole level --------------------------------------------------------------------------
    async def level(self, level: str, streams: int, shape: Shape, tokens: int) -> float:
        """CPU seconds for `streams` concurrent streams of `tokens` tokens at `level`."""
        expected = streams * shape.n * (1 if level == "grpc" else shape.prompts)  # gRPC takes one prompt
        start = time.process_time()
        feeder = asyncio.ensure_future(self.source.run(expected))
        self.source.finished = 0
        counts = await asyncio.gather(*(self.one(level, i, shape, tokens) for i in range(streams)))
        await feeder
        spent = time.process_time() - start
        assert all(counts), f"a {level} stream read nothing"
        return spent


async def _drain(stream) -> int:
    count = 0
    async for _ in stream:
        count += 1
    return count


def event_stream(gateway, rid: str, prompts, params, shape: Shape):
    """The SSE events of one request, as the HTTP app streams them."""
    from services.gateway.event_streams import chat_events, completion_events
    from services.gateway.responses import Formatter

    fmt = Formatter(gateway.tokenizer, f"cmpl-{rid}", "bench", 2 if shape.logprobs else None)
    events = chat_events if shape.chat else completion_events
    return events(gateway, prompts, params, fmt, shape.include_usage)


async def measure(args, shape: Shape) -> dict[str, float]:
    bench = Bench(args.tokens_per_turn, args.http)
    await bench.start()
    tokens_total = args.streams * args.tokens * shape.n * shape.prompts
    grpc_tokens = args.streams * args.tokens * shape.n  # a gRPC request has one prompt
    await bench.level("http", min(args.streams, 8), shape, args.tokens)  # warm caches and lazy imports
    result = {}
    for level in LEVELS:
        runs = []
        for _ in range(args.repeat):
            gc.collect()
            runs.append(await bench.level(level, args.streams, shape, args.tokens))
        tokens = grpc_tokens if level == "grpc" else tokens_total
        result[level] = min(runs) / tokens * 1e6  # the least disturbed run (the machine may be shared)
    if args.profile:
        result["profile"] = await profile(bench, args, shape, tokens_total)
    if args.show_body:
        print(bench.sample_body.decode()[:2000])
    return result


async def profile(bench: Bench, args, shape: Shape, tokens_total: int) -> dict[str, float]:
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    await bench.level(args.profile, args.streams, shape, args.tokens)
    profiler.disable()
    stats = pstats.Stats(profiler)
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)
    shares: dict[str, float] = {}
    for (path, _, func), (_, _, tottime, _, _) in stats.stats.items():
        category = _category(path, func)
        shares[category] = shares.get(category, 0.0) + tottime
    total = sum(shares.values())
    return {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


_CATEGORIES = (
    ("turn source", ("gateway_path",)),
    ("router loop", ("services/router/", "deltas.py")),
    ("gateway merge", ("stream_merge.py", "services/gateway/core.py")),
    ("chunk building", ("responses.py", "chunks.py")),
    ("SSE framing", ("http_app.py", "event_streams.py")),
    ("gRPC messages", ("grpc_service.py", "messages.py", "grpc_util.py")),
    ("HTTP server", ("starlette", "fastapi", "uvicorn", "h11", "anyio")),
    ("metrics", ("prometheus_client",)),
    ("event loop", ("asyncio",)),
)


def _category(path: str, func: str) -> str:
    if "json" in path or "encode_basestring" in func or "JSONEncoder" in func or "make_encoder" in func:
        return "JSON"
    for name, parts in _CATEGORIES:
        if any(p in path for p in parts):
            return name
    if path == "~":
        if "translate" in func or "join" in func or "encode" in func:
            return "SSE framing"
        return "builtins"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--shapes", default="completions,chat")
    ap.add_argument("--repeat", type=int, default=3, help="runs per level; the fastest counts")
    ap.add_argument("--tokens-per-turn", type=int, default=1, help="deltas each stream gets per turn")
    ap.add_argument("--http", default="h11", choices=("h11", "httptools"), help="uvicorn's HTTP/1.1 protocol")
    ap.add_argument("--profile", choices=LEVELS, help="split this level's time by stage under cProfile")
    ap.add_argument("--top", type=int, default=0, help="with --profile: also print the N costliest functions")
    ap.add_argument("--show-body", action="store_true", help="print the start of one HTTP response")
    args = ap.parse_args()
    import uvloop

    print(
        f"{args.streams} streams x {args.tokens} tokens, {args.tokens_per_turn} per turn, uvicorn {args.http}; "
        "µs of CPU per token"
    )
    header = (
        "| shape | " + " | ".join(LEVELS) + " | router | gateway | sse | http server | head (http - source) | grpc |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    profiles = {}
    for name in args.shapes.split(","):
        r = uvloop.run(measure(args, SHAPES[name]))
        stages = (
            r["router"] - r["source"],
            r["gateway"] - r["router"],
            r["sse"] - r["gateway"],
            r["http"] - r["sse"],
            r["http"] - r["source"],
            r["grpc"] - r["gateway"],
        )
        cells = [f"{r[lv]:.1f}" for lv in LEVELS] + [f"{s:.1f}" for s in stages]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        if "profile" in r:
            profiles[name] = (r["profile"], r[args.profile])
    for name, (shares, per_token) in profiles.items():
        print(f"\n{name}, level {args.profile} under cProfile: share of its time and µs per token")
        for category, share in shares.items():
            print(f"  {category:16s} {share * 100:5.1f} %  {share * per_token:6.1f}")


if __name__ == "__main__":
    main()
