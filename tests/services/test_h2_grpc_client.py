"""The package's gRPC client (`services/common/h2_grpc/client.py`, `H2Channel`) against both
servers a worker may run, over 127.0.0.1: the gateway's own (`H2GrpcServer`) and grpc's
(`grpc.aio.server`). Unary and server-streaming calls with metadata both ways; failures raised as
`grpc.aio`'s calls raise them (status, details, trailing metadata); a deadline and a cancel reset
the stream and free the handler; a refused connection, a server that stops mid-stream and one
that goes away are UNAVAILABLE; the channel connects again afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest

from services.common.h2_grpc.client import H2Channel
from tests.helpers.grpc_served import WAIT_S, Handlers, same


class _Server:
    """The test service `t.T` on one server kind, on the test's own loop."""

    def __init__(self, kind: str):
        self.kind = kind
        self.handlers = Handlers()

    async def start(self, port: int = 0) -> str:
        from services.common.grpc_util import new_server

        h = self.handlers
        h.release = asyncio.Event()
        self.server = new_server(1 << 20, kind=self.kind)
        methods = {
            "Echo": grpc.unary_unary_rpc_method_handler(h.echo, same, same),
            "Count": grpc.unary_stream_rpc_method_handler(h.count, same, same),
            "Refuse": grpc.unary_unary_rpc_method_handler(h.refuse, same, same),
            "Wait": grpc.unary_unary_rpc_method_handler(h.wait, same, same),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", methods),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def _channel(kind: str):
    """A server of `kind` and a channel to it, both closed after."""
    server = _Server(kind)
    ch = H2Channel(await server.start())
    try:
        yield server, ch
    finally:
        await ch.close()
        await server.server.stop(0)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


@pytest.fixture(params=["h2", "grpcio"])
def kind(request):
    return request.param


def test_unary_and_streaming_calls_with_metadata(kind):
    async def run():
        async with _channel(kind) as (server, ch):
            echo = ch.unary_unary("/t.T/Echo", same, same)
            replies = await asyncio.gather(
                *(echo(b"%d" % i, timeout=WAIT_S, metadata=(("x-n", str(i)),)) for i in range(50))
            )
            seen = server.handlers.seen["metadata"]
            call = ch.unary_stream("/t.T/Count", same, same)(b"300:20", timeout=WAIT_S)
            await call.initial_metadata()
            messages = [m async for m in call]
            return replies, seen, messages, await call.code(), call.done()

    replies, seen, messages, code, done = _run(run())
    assert replies == [b"echo:%d" % i for i in range(50)] and "x-n" in seen
    assert [m.rstrip(b".") for m in messages] == [b"%d" % i for i in range(300)]
    assert code == grpc.StatusCode.OK and done


def test_a_failure_is_raised_as_grpc_raises_it(kind):
    async def run():
        async with _channel(kind) as (server, ch):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/t.T/Refuse", same, same)(b"", timeout=WAIT_S)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await ch.unary_unary("/t.T/Nope", same, same)(b"", timeout=WAIT_S)
            return e.value, missing.value

    refused, missing = _run(run())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details() == "no such thing: é 100%"
    trailing = dict(refused.trailing_metadata())
    assert trailing["retry-after"] == "3" and trailing["x-raw-bin"] == b"\x00\xff"
    assert missing.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_deadline_and_a_cancel_free_the_handler(kind):
    async def run():
        async with _channel(kind) as (server, ch):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/t.T/Wait", same, same)(b"", timeout=0.3)
            call = ch.unary_stream("/t.T/Count", same, same)(b"100000:10")
            got = 0
            async for _ in call:
                got += 1
                if got == 10:
                    break
            call.cancel()
            for _ in range(int(WAIT_S / 0.05)):
                if server.handlers.cancelled.count("wait") and "count" in server.handlers.cancelled:
                    break
                await asyncio.sleep(0.05)
            return e.value.code(), await call.code(), list(server.handlers.cancelled)

    deadline_code, cancelled_code, cancelled = _run(run())
    assert deadline_code == grpc.StatusCode.DEADLINE_EXCEEDED and cancelled_code == grpc.StatusCode.CANCELLED
    assert "wait" in cancelled and "count" in cancelled, "the server was not told"


def test_no_server_a_server_gone_and_a_server_back_are_told_apart(kind):
    async def run():
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        ch = H2Channel(address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await ch.unary_unary("/t.T/Echo", same, same)(b"", timeout=WAIT_S)
            server = _Server(kind)
            await server.start(int(address.rpartition(":")[2]))
            echo = ch.unary_unary("/t.T/Echo", same, same)
            first = await echo(b"a", timeout=WAIT_S)  # connects now
            stream = ch.unary_stream("/t.T/Count", same, same)(b"100000:10")
            async for _ in stream:
                break
            await server.server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                async for _ in stream:
                    pass
            again = _Server(kind)
            await again.start(int(address.rpartition(":")[2]))
            second = await echo(b"b", timeout=WAIT_S)  # a new connection
            await again.server.stop(0)
            return refused.value.code(), first, gone.value.code(), second
        finally:
            await ch.close()

    refused, first, gone, second = _run(run())
    assert refused == grpc.StatusCode.UNAVAILABLE and gone == grpc.StatusCode.UNAVAILABLE
    assert (first, second) == (b"echo:a", b"echo:b")


def test_keepalive_finds_a_silent_server_only_while_calls_are_open():
    """A server that never answers (a machine gone without a FIN): an open call ends UNAVAILABLE
    once a PING goes unanswered; a connection with no call open sends no PING, so it stays."""

    async def run():
        held = []

        async def silent(reader, writer):
            held.append(writer)  # reads nothing, answers nothing
            await asyncio.sleep(WAIT_S)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        idle = H2Channel(address, keepalive_s=0.1, keepalive_timeout_s=0.2)
        busy = H2Channel(address, keepalive_s=0.1, keepalive_timeout_s=0.2)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await idle.unary_unary("/t.T/Echo", same, same)(b"", timeout=0.05)
            idle_conn = await idle.connection()
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await busy.unary_unary("/t.T/Echo", same, same)(b"")  # no deadline: only keepalive ends it
            waited = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0.5)
            kept = await idle.connection() is idle_conn and not idle_conn.transport.is_closing()
            return expired.value.code(), gone.value.code(), waited, kept
        finally:
            await idle.close()
            await busy.close()
            server.close()
            for w in held:
                w.close()

    expired, gone, waited, kept = _run(run())
    assert expired == grpc.StatusCode.DEADLINE_EXCEEDED and gone == grpc.StatusCode.UNAVAILABLE
    assert waited < 5.0 and kept, "the idle connection was pinged (and, unanswered, closed)"
