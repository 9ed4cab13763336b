"""What streaming SSE over HTTP/1.1 costs a server on this machine before any of the gateway's work:
a bare server (an asyncio protocol on uvloop, httptools parsing the request, as uvicorn's) answers
each streamed completion with the head and its first event in one write, one event a tick after
that (each in a write of its own, as a decode step gives each stream a token), and its last event
with `[DONE]` and the body's end in one write: the writes the gateway makes for a stream. The
service-layer benchmark's clients (`service_layer_sse.HttpConnection`) read the streams in
processes of their own, one keep-alive connection per stream slot, requests back to back.

    python -m benchmarks.sse_floor [--streams 1024] [--events 64] [--step-ms 10] [--seconds 10]
                                   [--servers bare,uvicorn]

`--servers uvicorn` serves the same streams from a bare ASGI app on uvicorn (httptools): one `send`
an event and the head apart, as an ASGI streaming response sends them; the reference for what a
Python front door on the standard stack costs per event before any work of its own.

Prints the events delivered, the server process's CPU per event and per request (from /proc), and
the clients' per event. Over loopback a write also runs the receiving socket's TCP processing and
wakes its reader, on the writer's CPU: that is most of the floor, and what a head whose clients are
on other hosts would not pay. The gateway's figure in `service_layer` less this floor is what the
gateway and the router themselves add.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

from benchmarks.floor_harness import run_floor

EVENT = (
    b'data: {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1796688208, '
    b'"model": "bench", "choices": [{"index": 0, "text": " w12", "logprobs": null, "finish_reason": null, '
    b'"stop_reason": null}], "usage": null}\n\n'
)
"""A running `text_completion` chunk of one token, as the gateway writes it."""
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def _chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def _server_main(kind: str, events: int, step_s: float, ready, port_box, stop) -> None:
    if kind == "uvicorn":
        return _uvicorn_main(events, step_s, ready, port_box, stop)
    import httptools
    import uvloop

    streams: dict = {}  # transport -> events still to send

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            self.transport.write(HEAD + _chunk(EVENT))
            streams[self.transport] = events - 1

        def connection_lost(self, exc) -> None:
            streams.pop(self.transport, None)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1", 0, backlog=4096)
        port_box.value = server.sockets[0].getsockname()[1]
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(step_s)
            for transport, left in list(streams.items()):
                if left > 1:
                    transport.write(_chunk(EVENT))
                    streams[transport] = left - 1
                else:
                    transport.write(_chunk(EVENT + DONE) + b"0\r\n\r\n")
                    del streams[transport]
        server.close()

    uvloop.run(main())


def _uvicorn_main(events: int, step_s: float, ready, port_box, stop) -> None:
    """The same streams from a bare ASGI app on uvicorn (httptools): one `send` an event, the head
    apart, as an ASGI streaming response sends them."""
    import socket

    import uvicorn
    import uvloop

    tick = [None]
    """The event every stream waits for between two of its events, replaced each tick."""

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events - 1):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await tick[0].wait()
        await send({"type": "http.response.body", "body": EVENT + DONE, "more_body": False})

    async def main() -> None:
        tick[0] = asyncio.Event()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port_box.value = sock.getsockname()[1]
        config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", backlog=4096)
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(step_s)
            event, tick[0] = tick[0], asyncio.Event()
            event.set()
        server.should_exit = True
        await serving

    uvloop.run(main())


def _client_main(port: int, streams: int, seconds: float, go, results) -> None:
    import uvloop

    from benchmarks.service_layer_sse import HttpConnection

    async def main() -> None:
        go.wait()
        stop = time.monotonic() + seconds
        count = [0, 0]  # events, requests

        def on_event(obj) -> None:
            count[0] += 1

        async def slot() -> None:
            conn = HttpConnection(f"http://127.0.0.1:{port}")
            while time.monotonic() < stop:
                await conn.stream_events("/v1/completions", {"stream": True}, on_event)
                count[1] += 1
            conn.close()

        cpu = time.process_time()
        await asyncio.gather(*[slot() for _ in range(streams)])
        results.put((count[0], count[1], time.process_time() - cpu))

    uvloop.run(main())


def measure(kind: str, streams: int, events: int, step_s: float, clients: int, seconds: float) -> dict:
    run = run_floor(_server_main, (kind, events, step_s), _client_main, (seconds,), streams, clients, seconds + 120)
    delivered, requests = sum(d[0] for d in run.results), sum(d[1] for d in run.results)
    if delivered != requests * events:
        raise RuntimeError(f"{delivered} events delivered for {requests} requests of {events}")
    return {
        "server": kind,
        "events": delivered,
        "requests": requests,
        "seconds": run.seconds,
        "server_us": run.server_cpu_s / delivered * 1e6,
        "server_us_request": run.server_cpu_s / requests * 1e6,
        "clients_us": sum(d[2] for d in run.results) / delivered * 1e6,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--events", type=int, default=64, help="events per request (the request's tokens)")
    p.add_argument("--step-ms", type=float, default=10.0, help="one event to every stream this often")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--seconds", type=float, default=10.0, help="how long the clients make requests")
    p.add_argument("--servers", default="bare,uvicorn", help="bare (the floor), uvicorn (a bare ASGI app on it)")
    args = p.parse_args(argv)
    rows = [
        measure(kind, args.streams, args.events, args.step_ms / 1e3, args.clients, args.seconds)
        for kind in args.servers.split(",")
    ]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"\nSSE floor: {args.streams} streams, {args.events} events a request, a tick every {args.step_ms:g} ms, "
        f"{args.clients} client processes; {platform.machine()}, {os.cpu_count()} CPUs, {when}\n"
    )
    print("| server | events | events/s | requests | server µs/event | server µs/request | clients µs/event |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['server']} | {r['events']} | {r['events'] / r['seconds']:,.0f} | {r['requests']} "
            f"| {r['server_us']:.1f} | {r['server_us_request']:.0f} | {r['clients_us']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
