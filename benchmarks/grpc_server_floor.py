"""What a gRPC server itself costs a streamed message: `grpc.aio`'s server against the gateway's own
(`services/common/h2_grpc`), each serving one server-streaming method whose handler only relays
ready bytes, one message a tick to every open stream (as a decode step gives each stream a token).
grpc's own asyncio clients read the streams in processes of their own.

    python -m benchmarks.grpc_server_floor [--streams 1024] [--messages 200] [--step-ms 20] [--calls 1]

Prints, for each server, the messages delivered, the server process's CPU time per message and per
call (from /proc), the clients' per message, and the ratio of the two servers' figures. With
`--calls N` each of the `--streams` slots makes N calls one after the other: few messages a call
measure what a call itself costs (its headers, its status, its handler's task).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import grpc

from benchmarks.floor_harness import run_floor

MESSAGE = b"\x0a\x20" + b"r" * 32 + b"\x12\x12\x08\x05\x12\x02\x81\x01\x18\x07\x22\x06 hello"
"""About a `GenerateResponse` of one token: its request id, offsets, the token and its text."""
METHOD = "/bench.Floor/Stream"


def _same(x):
    return x


def _server_main(kind: str, messages: int, step_s: float, ready, port_box, stop) -> None:
    import uvloop

    from services.common.h2_grpc import H2GrpcServer

    async def main() -> None:
        tick = [asyncio.Event()]

        async def stream(request, context):
            for _ in range(messages):
                await tick[0].wait()
                yield MESSAGE

        handler = grpc.unary_stream_rpc_method_handler(stream, _same, _same)
        server = grpc.aio.server() if kind == "grpcio" else H2GrpcServer()
        server.add_registered_method_handlers("bench.Floor", {"Stream": handler})
        port_box.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(step_s)
            event, tick[0] = tick[0], asyncio.Event()
            event.set()
        await server.stop(0)

    uvloop.run(main())


def _client_main(port: int, streams: int, calls: int, go, results) -> None:
    import uvloop

    async def main() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        method = channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)
        go.wait()

        async def one() -> int:
            count = 0
            for _ in range(calls):
                count += sum([1 async for _ in method(b"")])
            return count

        cpu = time.process_time()
        counts = await asyncio.gather(*[one() for _ in range(streams)])
        results.put((sum(counts), time.process_time() - cpu))
        await channel.close()

    uvloop.run(main())


def measure(kind: str, streams: int, messages: int, step_s: float, clients: int, calls: int = 1) -> dict:
    run = run_floor(_server_main, (kind, messages, step_s), _client_main, (calls,), streams, clients, 600)
    delivered = sum(d[0] for d in run.results)
    if delivered != streams * messages * calls:
        raise RuntimeError(f"{kind}: {delivered} messages delivered of {streams * messages * calls}")
    return {
        "server": kind,
        "messages": delivered,
        "seconds": run.seconds,
        "server_us": run.server_cpu_s / delivered * 1e6,
        "server_us_call": run.server_cpu_s / (streams * calls) * 1e6,
        "clients_us": sum(d[1] for d in run.results) / delivered * 1e6,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--messages", type=int, default=200, help="messages per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="one message to every stream this often")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--calls", type=int, default=1, help="calls each stream slot makes, one after the other")
    p.add_argument("--servers", default="grpcio,h2")
    args = p.parse_args(argv)
    rows = [
        measure(kind, args.streams, args.messages, args.step_ms / 1e3, args.clients, args.calls)
        for kind in args.servers.split(",")
    ]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"\ngRPC server floor: {args.streams} streams x {args.calls} call(s) x {args.messages} messages, "
        f"a tick every {args.step_ms:g} ms, "
        f"{args.clients} client processes; {platform.machine()}, {os.cpu_count()} CPUs, {when}\n"
    )
    print("| server | messages | messages/s | server µs/message | server µs/call | clients µs/message |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = r["messages"] / r["seconds"]
        print(
            f"| {r['server']} | {r['messages']} | {rate:,.0f} | {r['server_us']:.1f} | {r['server_us_call']:.0f} "
            f"| {r['clients_us']:.1f} |"
        )
    if len(rows) == 2:
        print(
            f"\n{rows[1]['server']} / {rows[0]['server']} server CPU per message: {rows[1]['server_us'] / rows[0]['server_us']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
