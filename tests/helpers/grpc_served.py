"""A test gRPC service (`t.T`) on an `H2GrpcServer` running on its own event loop in a thread, for
grpc's own clients and raw HTTP/2 clients to call."""

from __future__ import annotations

import asyncio
import threading

import grpc

from services.common.grpc_util import enable_reflection
from services.common.h2_grpc import H2GrpcServer

WAIT_S = 30.0
LIMIT = 1 << 20


def same(x):
    return x


class Handlers:
    """The test service `t.T`; what its handlers saw, for the tests to check."""

    def __init__(self):
        self.seen: dict = {}
        self.sent = 0
        self.cancelled: list[str] = []
        self.release = None  # asyncio.Event, made on the server's loop

    async def echo(self, request, context):
        self.seen["metadata"] = dict(context.invocation_metadata())
        self.seen["time_remaining"] = context.time_remaining()
        return b"echo:" + request

    async def count(self, request, context):
        """As many messages as the request says (`n[:size]`), each its index padded to `size`."""
        n, _, size = request.partition(b":")
        try:
            for i in range(int(n)):
                self.sent = i + 1
                yield str(i).encode().ljust(int(size or 0), b".")
        finally:
            if self.sent < int(n):  # cancelled, or closed by the server while it was sending
                self.cancelled.append("count")

    async def upper(self, requests, context):
        async for r in requests:
            yield r.upper()

    async def join(self, requests, context):
        return b"+".join([r async for r in requests])

    async def refuse(self, request, context):
        await context.send_initial_metadata((("x-first", "1"),))
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "no such thing: é 100%",
            trailing_metadata=(("retry-after", "3"), ("x-raw-bin", b"\x00\xff")),
        )

    async def crash(self, request, context):
        raise RuntimeError("boom")

    async def wait(self, request, context):
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append("wait")
            raise
        return b"released"

    async def hold(self, requests, context):
        """Reads nothing until released, then counts what came."""
        await self.release.wait()
        return b"%d" % sum([1 async for _ in requests])

    def unimplemented(self, request, context):  # what a generated servicer's base method does
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("Method not implemented!")
        raise NotImplementedError("Method not implemented!")


class Served:
    def __init__(self, **options):
        """`options`: the server's (`H2GrpcServer`)."""
        self.options = options
        self.handlers = Handlers()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.start_server()
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc) -> None:
        stop(self)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def start_server(self) -> H2GrpcServer:
        h = self.handlers

        async def start():
            h.release = asyncio.Event()
            server = H2GrpcServer(max_receive_bytes=LIMIT, **self.options)
            methods = {
                "Echo": grpc.unary_unary_rpc_method_handler(h.echo, same, same),
                "Count": grpc.unary_stream_rpc_method_handler(h.count, same, same),
                "Upper": grpc.stream_stream_rpc_method_handler(h.upper, same, same),
                "Join": grpc.stream_unary_rpc_method_handler(h.join, same, same),
                "Refuse": grpc.unary_unary_rpc_method_handler(h.refuse, same, same),
                "Crash": grpc.unary_unary_rpc_method_handler(h.crash, same, same),
                "Wait": grpc.unary_unary_rpc_method_handler(h.wait, same, same),
                "Hold": grpc.stream_unary_rpc_method_handler(h.hold, same, same),
                "Unimplemented": grpc.unary_unary_rpc_method_handler(h.unimplemented, same, same),
            }
            server.add_registered_method_handlers("t.T", methods)
            enable_reflection(server, ["t.T"])
            self.port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server

        return self.call(start())


def end_loop(s: Served) -> None:
    s.loop.call_soon_threadsafe(s.loop.stop)
    s.thread.join(10)


def stop(s: Served) -> None:
    s.call(s.server.stop(0))
    end_loop(s)
