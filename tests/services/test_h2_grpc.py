"""The gateway's own gRPC server (`services/common/h2_grpc`) against grpc's own clients over
127.0.0.1: the four kinds of method, statuses with details and metadata, deadlines, cancellation,
flow control both ways, compression, the size limit, reflection, a stop that lets calls finish, and
many streams on one connection."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from services.common.h2_grpc import http2
from tests.helpers.grpc_served import LIMIT, WAIT_S, Served, end_loop, same, stop
from tests.helpers.raw_http2 import RawClient, message, request_block


@pytest.fixture(scope="module")
def served():
    with Served() as s:
        yield s


@pytest.fixture
def channel(served):
    with grpc.insecure_channel(served.address) as ch:
        yield ch


def _method(channel, name: str, kind: str = "unary_unary"):
    return getattr(channel, kind)(f"/t.T/{name}", request_serializer=same, response_deserializer=same)


def test_the_four_kinds_of_method(served, channel):
    assert _method(channel, "Echo")(b"hi", timeout=WAIT_S) == b"echo:hi"
    got = list(_method(channel, "Count", "unary_stream")(b"500", timeout=WAIT_S))
    assert got == [str(i).encode() for i in range(500)]
    assert list(_method(channel, "Upper", "stream_stream")(iter([b"a", b"bc"]), timeout=WAIT_S)) == [b"A", b"BC"]
    assert _method(channel, "Join", "stream_unary")(iter([b"x", b"y", b"z"]), timeout=WAIT_S) == b"x+y+z"
    assert served.handlers.seen["time_remaining"] is not None and 0 < served.handlers.seen["time_remaining"] <= WAIT_S


def test_metadata_both_ways_and_a_status_with_details(served, channel):
    reply = _method(channel, "Echo")(b"", metadata=(("authorization", "Bearer k"), ("x-id-bin", b"\x01\x02")))
    assert reply == b"echo:"
    seen = served.handlers.seen["metadata"]
    assert seen["authorization"] == "Bearer k" and seen["x-id-bin"] == b"\x01\x02"
    with pytest.raises(grpc.RpcError) as e:
        _method(channel, "Refuse")(b"", timeout=WAIT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "no such thing: é 100%"
    assert dict(e.value.initial_metadata())["x-first"] == "1"
    trailing = dict(e.value.trailing_metadata())
    assert trailing["retry-after"] == "3" and trailing["x-raw-bin"] == b"\x00\xff"


def test_failures_become_statuses(channel):
    cases = {
        "Crash": (grpc.StatusCode.UNKNOWN, "boom"),
        "Unimplemented": (grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!"),
        "NoSuchMethod": (grpc.StatusCode.UNIMPLEMENTED, "/t.T/NoSuchMethod"),
    }
    for name, (code, words) in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            _method(channel, name)(b"", timeout=WAIT_S)
        assert e.value.code() == code and words in e.value.details(), name


def test_the_size_limit_and_compressed_requests(channel):
    with pytest.raises(grpc.RpcError) as e:
        _method(channel, "Echo")(b"x" * (LIMIT + 1), timeout=WAIT_S)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(LIMIT) in e.value.details()
    big = bytes(range(256)) * 3000  # 768 KB: many DATA frames, past the default windows
    assert _method(channel, "Echo")(big, timeout=WAIT_S) == b"echo:" + big
    text = b"compressible " * 10_000
    assert _method(channel, "Echo")(text, timeout=WAIT_S, compression=grpc.Compression.Gzip) == b"echo:" + text


def test_large_responses_are_framed_within_the_peer_limits(channel):
    got = list(_method(channel, "Count", "unary_stream")(b"40:100000", timeout=WAIT_S))  # 4 MB in 100 KB messages
    assert [g.rstrip(b".") for g in got] == [str(i).encode() for i in range(40)] and {len(g) for g in got} == {100000}


def test_a_deadline_ends_the_call_and_cancels_its_handler(served, channel):
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _method(channel, "Wait")(b"", timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5
    deadline = time.monotonic() + WAIT_S
    while "wait" not in served.handlers.cancelled:
        assert time.monotonic() < deadline, "the handler was not cancelled"
        time.sleep(0.02)


def test_a_client_that_cancels_cancels_the_handler(served, channel):
    stream = _method(channel, "Count", "unary_stream")(b"100000000:64", timeout=WAIT_S)
    for i, _ in enumerate(stream):
        if i == 100:
            break
    stream.cancel()
    deadline = time.monotonic() + WAIT_S
    while "count" not in served.handlers.cancelled:
        assert time.monotonic() < deadline, "the handler was not cancelled"
        time.sleep(0.02)
    calls = served.call(_open_calls(served.server))
    assert calls == 0, "the cancelled call is still held"


async def _open_calls(server) -> int:
    return sum(len(c.calls) for c in server.connections)


def test_a_client_that_does_not_read_holds_the_handler(served):
    """HTTP/2 flow control: with the client's window full, the handler waits; once the client reads,
    every message arrives, in order."""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(served.address, options=options) as ch:
        # 600 KB; with this client's 1 KB windows each message waits for a WINDOW_UPDATE of its own
        stream = _method(ch, "Count", "unary_stream")(b"600:1000", timeout=WAIT_S)
        first = next(stream)
        held, deadline = -1, time.monotonic() + WAIT_S
        while served.handlers.sent != held:  # until the handler stops sending (held, or done)
            assert time.monotonic() < deadline, "the handler never stopped"
            held = served.handlers.sent
            time.sleep(0.5)
        assert held < 600, "the handler was not held back by the client's window"
        rest = list(stream)
    assert [m.rstrip(b".") for m in [first, *rest]] == [str(i).encode() for i in range(600)]


def test_many_streams_on_one_connection(channel):
    """300 streams at once on one connection: each gets its own messages, in order."""
    count = _method(channel, "Count", "unary_stream")
    calls = [count(b"%d:8" % (50 + i % 7), timeout=WAIT_S) for i in range(300)]
    for i, call in enumerate(calls):
        assert [m.rstrip(b".") for m in call] == [str(k).encode() for k in range(50 + i % 7)]


def test_closed_streams_are_not_held(served, channel):
    """The connection drops the calls that finished: only open streams are held."""
    echo = _method(channel, "Echo")
    for i in range(300):
        assert echo(b"%d" % i, timeout=WAIT_S) == b"echo:%d" % i

    async def held() -> list[int]:
        return [len(c.calls) for c in served.server.connections]

    assert max(served.call(held())) == 0


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {"t.T", "grpc.reflection.v1alpha.ServerReflection"}


def test_bytes_that_are_not_http2_close_only_their_connection(served, channel):
    with socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 100)
        sock.settimeout(WAIT_S)
        while sock.recv(1 << 16):  # the server answers with GOAWAY, then closes
            pass
    assert _method(channel, "Echo")(b"still", timeout=WAIT_S) == b"echo:still"


def _waiting_call(s: Served, ch):
    """A `Wait` call, once the server holds it."""
    future = _method(ch, "Wait").future(b"", timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while s.call(_open_calls(s.server)) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return future


def test_a_stop_lets_calls_in_flight_finish():
    s = Served()
    try:
        with grpc.insecure_channel(s.address) as ch:
            future = _waiting_call(s, ch)
            stopping = asyncio.run_coroutine_threadsafe(s.server.stop(WAIT_S), s.loop)
            time.sleep(0.2)
            with pytest.raises(OSError):  # no new connections
                socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
            s.loop.call_soon_threadsafe(s.handlers.release.set)
            assert future.result(WAIT_S) == b"released"
            stopping.result(WAIT_S)
    finally:
        end_loop(s)


def test_calls_still_running_when_the_grace_ends_are_told_so():
    s = Served()
    try:
        with grpc.insecure_channel(s.address) as ch:
            future = _waiting_call(s, ch)
            s.call(s.server.stop(0.2))
            with pytest.raises(grpc.RpcError) as e:
                future.result(WAIT_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        end_loop(s)


def test_keepalive_pings_close_a_connection_whose_client_is_gone():
    """A client that answers no PING (here: one that stopped reading its socket, as a machine
    that vanished would) loses its connection, and its calls are cancelled; grpc's own client
    answers them and keeps its call."""
    s = Served(keepalive_s=0.2, keepalive_timeout_s=0.3)
    try:
        with grpc.insecure_channel(s.address) as ch:
            alive = _method(ch, "Wait").future(b"", timeout=WAIT_S)
            silent = RawClient(s.port, timeout_s=WAIT_S)
            try:
                request = http2.frame(http2.HEADERS, http2.END_HEADERS, 1, request_block(b"/t.T/Wait"))
                silent.send(request + http2.frame(http2.DATA, http2.END_STREAM, 1, message(b"")))
                # then it reads nothing, answers nothing
                deadline = time.monotonic() + WAIT_S
                while "wait" not in s.handlers.cancelled:
                    assert time.monotonic() < deadline, "the silent client's call was not cancelled"
                    time.sleep(0.05)
            finally:
                silent.close()
            time.sleep(1.0)  # several more keepalive rounds for grpc's client
            s.loop.call_soon_threadsafe(s.handlers.release.set)
            assert alive.result(WAIT_S) == b"released"
    finally:
        stop(s)


def test_a_handler_that_does_not_read_holds_a_streaming_client():
    """Request messages wait for their handler only up to the client's window: past it the client
    is held, and once the handler reads, every message arrives."""
    s = Served()
    size, count, sent = 64 * 1024, 600, [0]

    def requests():
        for _ in range(count):
            sent[0] += 1
            yield b"x" * size

    async def queued() -> int:
        return max((len(c._requests) for conn in s.server.connections for c in conn.calls.values()), default=0)

    try:
        with grpc.insecure_channel(s.address) as ch:
            future = _method(ch, "Hold", "stream_unary").future(requests(), timeout=WAIT_S)
            held, deadline = -1, time.monotonic() + WAIT_S
            while sent[0] != held:  # until the client stops sending (held, or done)
                assert time.monotonic() < deadline, "the client never stopped sending"
                held = sent[0]
                time.sleep(0.5)
            waiting = s.call(queued())
            assert held < count, "the client was not held"
            assert 0 < waiting <= (16 << 20) // size + 8 + 2, (held, waiting)
            s.loop.call_soon_threadsafe(s.handlers.release.set)
            assert future.result(WAIT_S) == b"%d" % count
    finally:
        stop(s)
