"""The gRPC server's HTTP/2 (`services/common/h2_grpc/connection.py`) against a raw client on
127.0.0.1: what grpc's own clients never send but a peer may — header blocks in CONTINUATION
frames, padding and priority, a lowered header table, small flow-control windows opened by
WINDOW_UPDATE and SETTINGS, PINGs — and the errors: a malformed request resets only its stream,
a protocol violation ends the connection with GOAWAY and its code."""

from __future__ import annotations

import contextlib

import pytest

from services.common.h2_grpc import http2
from tests.helpers.grpc_served import WAIT_S, Served
from tests.helpers.raw_http2 import RawClient, message, request_block


@pytest.fixture(scope="module")
def served():
    with Served() as s:
        yield s


@contextlib.contextmanager
def _client(served, settings=None):
    """A raw client past the SETTINGS exchange, closed after."""
    client = RawClient(served.port, settings, timeout_s=WAIT_S)
    try:
        client.until(lambda f: f.kind == http2.SETTINGS and f.flags & http2.ACK, "the SETTINGS ACK")
        yield client
    finally:
        client.close()


def _echo(client: RawClient, sid: int, payload: bytes) -> tuple[dict, bytes, dict]:
    """The response to an Echo sent on `sid` as one HEADERS and one DATA: its headers, its message
    bytes, its trailers."""
    client.send(
        http2.frame(http2.HEADERS, http2.END_HEADERS, sid, request_block(b"/t.T/Echo"))
        + http2.frame(http2.DATA, http2.END_STREAM, sid, message(payload))
    )
    return _response(client, sid)


def _response(client: RawClient, sid: int) -> tuple[dict, bytes, dict]:
    headers, data = None, b""
    while True:
        f = client.until(lambda f: f.stream_id == sid, f"stream {sid}'s response")
        if f.kind == http2.HEADERS:
            if headers is None:
                headers = client.headers(f)
                if f.flags & http2.END_STREAM:  # trailers-only
                    return headers, data, headers
                continue
            assert f.flags & http2.END_STREAM
            return headers, data, client.headers(f)
        assert f.kind == http2.DATA, f
        data += f.payload


def test_a_request_in_continuation_frames_with_padding_and_priority(served):
    with _client(served) as client:
        block = request_block(b"/t.T/Echo", [(b"x-big", b"v" * 40_000)])  # over one 16 KB frame
        first = bytes([3]) + b"\x00\x00\x00\x00\x10" + block[:10_000] + b"\x00" * 3  # pad 3, priority
        frames = http2.frame(http2.HEADERS, http2.PADDED | http2.PRIORITY_FLAG, 1, first)
        frames += http2.frame(http2.CONTINUATION, 0, 1, block[10_000:25_000])
        frames += http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, block[25_000:])
        padded = bytes([7]) + message(b"hi") + b"\x00" * 7
        client.send(frames + http2.frame(http2.DATA, http2.PADDED | http2.END_STREAM, 1, padded))
        headers, data, trailers = _response(client, 1)
        assert headers[b":status"] == b"200" and headers[b"content-type"] == b"application/grpc"
        assert data == message(b"echo:hi") and trailers[b"grpc-status"] == b"0"
        assert served.handlers.seen["metadata"]["x-big"] == "v" * 40_000


def test_pings_are_answered_and_a_smaller_header_table_is_acknowledged(served):
    with _client(served, {http2.HEADER_TABLE_SIZE: 0}) as client:
        client.send(http2.ping(b"12345678"))
        pong = client.until(lambda f: f.kind == http2.PING, "the PING's answer")
        assert pong.flags & http2.ACK and pong.payload == b"12345678"
        client.decoder.max_allowed_table_size = 0  # as this client's SETTINGS said
        client.send(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, request_block(b"/t.T/Echo")))
        client.send(http2.frame(http2.DATA, http2.END_STREAM, 1, message(b"t")))
        head = client.until(lambda f: f.kind == http2.HEADERS, "the response's HEADERS")
        assert head.payload[:1] == http2.table_size_update(0)
        assert client.headers(head)[b":status"] == b"200"


def test_small_windows_hold_a_response_until_the_client_opens_them(served):
    with _client(served, {http2.INITIAL_WINDOW_SIZE: 0}) as client:
        client.send(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, request_block(b"/t.T/Count")))
        client.send(http2.frame(http2.DATA, http2.END_STREAM, 1, message(b"3:100")))
        client.until(lambda f: f.kind == http2.HEADERS and f.stream_id == 1, "the response's HEADERS")
        client.send(http2.ping(b"barrier!"))  # nothing but the PING's answer may come first
        f = client.until(lambda f: f.kind in (http2.DATA, http2.PING), "a frame")
        assert f.kind == http2.PING, "DATA went past a closed window"
        client.send(http2.window_update(1, 40))
        f = client.until(lambda f: f.stream_id == 1, "DATA within the window")
        assert f.kind == http2.DATA and len(f.payload) == 40
        client.send(http2.settings_frame({http2.INITIAL_WINDOW_SIZE: 1 << 20}))  # every stream opens
        data = f.payload
        while True:
            f = client.until(lambda f: f.stream_id == 1, "the rest")
            if f.kind == http2.HEADERS:
                break
            data += f.payload
        assert data == b"".join(message(str(i).encode().ljust(100, b".")) for i in range(3))
        assert client.headers(f)[b"grpc-status"] == b"0"


def test_a_malformed_request_resets_its_stream_and_the_connection_serves_on(served):
    with _client(served) as client:
        bad = request_block(b"/t.T/Echo", [(b"X-Upper", b"1")])
        client.send(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, bad))
        reset = client.until(lambda f: f.stream_id == 1, "the reset")
        assert reset.kind == http2.RST_STREAM and int.from_bytes(reset.payload, "big") == http2.PROTOCOL_ERROR
        headers, data, trailers = _echo(client, 3, b"again")
        assert data == message(b"echo:again") and trailers[b"grpc-status"] == b"0"


@pytest.mark.parametrize(
    "frames, code",
    [
        (http2.frame(http2.DATA, 0, 0, b"x"), http2.PROTOCOL_ERROR),  # DATA on the connection
        (http2.frame(http2.DATA, 0, 9, b"x"), http2.PROTOCOL_ERROR),  # on a stream never opened
        (http2.frame(http2.HEADERS, http2.END_HEADERS, 2, request_block(b"/t.T/Echo")), http2.PROTOCOL_ERROR),
        (http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, b""), http2.PROTOCOL_ERROR),
        (http2.frame(http2.PING, 0, 0, b"short"), http2.FRAME_SIZE_ERROR),
        (http2.window_update(0, 2**31 - 1) * 2, http2.FLOW_CONTROL_ERROR),
        (http2.frame(http2.HEADERS, http2.END_HEADERS, 1, b"\xff\xff\xff\xff"), http2.COMPRESSION_ERROR),
        (b"\x01\x00\x00" + bytes((http2.DATA, 0)) + (1).to_bytes(4, "big"), http2.FRAME_SIZE_ERROR),  # 64 KB
    ],
    ids=[
        "data-on-0",
        "data-idle",
        "even-stream",
        "lone-continuation",
        "short-ping",
        "window-overflow",
        "bad-hpack",
        "frame-too-large",
    ],
)
def test_a_protocol_violation_ends_the_connection_with_its_code(served, frames, code):
    with _client(served) as client:
        client.send(frames)
        goaway = client.until(lambda f: f.kind == http2.GOAWAY, "GOAWAY")
        assert int.from_bytes(goaway.payload[4:8], "big") == code
        while client.frame() is not None:  # then the server closes the connection
            pass


def test_a_compressed_message_that_does_not_inflate_fails_only_its_call(served):
    with _client(served) as client:
        block = request_block(b"/t.T/Echo", [(b"grpc-encoding", b"gzip")])
        garbage = b"\x01" + (9).to_bytes(4, "big") + b"not gzip!"
        client.send(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block))
        client.send(http2.frame(http2.DATA, http2.END_STREAM, 1, garbage))
        _, _, trailers = _response(client, 1)
        assert trailers[b"grpc-status"] == b"13" and b"inflate" in trailers[b"grpc-message"]
        _, data, _ = _echo(client, 3, b"fine")
        assert data == message(b"echo:fine")
