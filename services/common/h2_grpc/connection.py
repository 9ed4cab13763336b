"""One client connection of an `H2GrpcServer`: the server side of HTTP/2 (RFC 9113), as gRPC uses it.

Why its own: a general HTTP/2 library builds an object for every frame, event and header and
checks each on the way in and out; for a call of a few small messages that cost more than the
rest of the server's work on it. Here a frame is parsed where it arrives and acted on at once, and
a response's headers are a block of HPACK literals (`http2.py`) whose constant part is made once.

What it keeps of the protocol:
- the client preface and SETTINGS (acknowledged; a new initial window moves every open stream's
  send window; the peer's maximum frame size bounds what is sent);
- streams opened by HEADERS (and CONTINUATION) on new odd ids, their header blocks decoded by
  `hpack.Decoder` and checked as RFC 9113 8.2-8.3 asks; a request past GOAWAY is refused;
- flow control both ways: each stream's and the connection's receive windows (16 MB, returned in
  WINDOW_UPDATEs of half a window once the handler took the bytes: `acknowledge`), and send windows
  that hold a message back until the client opens them (`pump`);
- RST_STREAM (the call is cancelled), PING (answered; ours are keepalives), GOAWAY, PRIORITY
  (ignored), padding;
- a connection error ends the connection with GOAWAY and its code; a stream error resets the stream.

Writes coalesce: everything sent while the event loop runs its ready callbacks (the messages of
many streams, the frames the protocol answers with, in order) leaves in one `transport.write`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import hpack
import hpack.exceptions

from services.common.h2_grpc import http2
from services.common.h2_grpc.call import ServerCall

logger = logging.getLogger(__name__)

_RECEIVE_WINDOW = 1 << 24
"""The connection's and each stream's receive window (a request message is bounded by the server's
size limit; a stream's messages are acknowledged as they arrive while few wait: `ServerCall.feed`)."""
_RETURN_AT = _RECEIVE_WINDOW // 2
"""Bytes taken before they are given back in one WINDOW_UPDATE: a unary request sends none."""
_MAX_HEADER_BLOCK = 1 << 20
"""A header block split over CONTINUATION frames may grow this large (the decoded list is bounded
by the decoder's own limit)."""
_LOCAL_SETTINGS = http2.settings_frame(
    {http2.MAX_CONCURRENT_STREAMS: 2**31 - 1, http2.INITIAL_WINDOW_SIZE: _RECEIVE_WINDOW}  # grpc's own server sets none
)
_CONNECTION_HEADERS = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))


class _ConnectionError(Exception):
    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


def _request_problem(headers: list) -> Optional[str]:
    """What makes a request's header list malformed (RFC 9113 8.2-8.3), or None."""
    pseudo_done = False
    seen = set()
    for name, value in headers:
        if name[:1] == b":":
            if pseudo_done:
                return "a pseudo-header after a regular header"
            if name not in _REQUEST_PSEUDO or name in seen:
                return f"pseudo-header {name!r} unknown or repeated"
            seen.add(name)
        else:
            pseudo_done = True
            if name.lower() != name:
                return f"header name {name!r} is not lowercase"
            if name in _CONNECTION_HEADERS or (name == b"te" and value != b"trailers"):
                return f"connection-specific header {name!r}"
    if len(seen & {b":method", b":scheme", b":path"}) != 3:
        return "a request needs :method, :scheme and :path"
    return None


class GrpcConnection(asyncio.Protocol):
    def __init__(self, server):
        """`server`: the `H2GrpcServer` that accepted it (its methods, limits and keepalive)."""
        self.server = server
        self.calls: dict[int, ServerCall] = {}
        self.transport: Optional[asyncio.Transport] = None
        self.paused = False
        """The socket's buffer is full (asyncio's write flow control): handlers wait."""
        self.going_away = False
        self.send_window = http2.DEFAULT_WINDOW
        """The connection's send window: what the client takes of all streams' DATA before it opens it."""
        self.initial_window = http2.DEFAULT_WINDOW
        """Each new stream's send window (the client's INITIAL_WINDOW_SIZE)."""
        self.max_frame = http2.DEFAULT_MAX_FRAME
        """The largest frame payload the client takes."""
        self.highest_stream_id = 0
        self._out = bytearray()
        self._flush_scheduled = False
        self._in = bytearray()
        self._preface = True
        """The client's preface is still due."""
        self._settings_seen = False
        self._decoder = hpack.Decoder()
        self._block: Optional[tuple[int, int, bytearray]] = None
        """A header block whose CONTINUATION frames are due: (stream id, HEADERS flags, block so far)."""
        self._receive_window = _RECEIVE_WINDOW
        self._taken = 0
        """Request bytes handlers took, not yet given back to the client's connection window."""
        self._table_update = b""
        """Prefixed to the next header block: the client lowered HEADER_TABLE_SIZE."""
        self._peer = ""
        self._loop = None
        self._keepalive = None
        """The timer of the next keepalive PING, or of the wait for its ACK."""
        self._ping_outstanding = False

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        if peer:
            family = "ipv6" if ":" in peer[0] else "ipv4"
            self._peer = f"{family}:{peer[0]}:{peer[1]}"
        self.server.connections.add(self)
        self._out += _LOCAL_SETTINGS + http2.window_update(0, _RECEIVE_WINDOW - http2.DEFAULT_WINDOW)
        self._flush()
        self._arm_keepalive()

    def data_received(self, data: bytes) -> None:
        buf = self._in
        buf += data
        if self._preface:
            if len(buf) < len(http2.PREFACE):
                if not http2.PREFACE.startswith(buf):
                    self._close_on("not an HTTP/2 client preface")
                return
            if buf[: len(http2.PREFACE)] != http2.PREFACE:
                return self._close_on("not an HTTP/2 client preface")
            del buf[: len(http2.PREFACE)]
            self._preface = False
        pos, size = 0, len(buf)
        try:
            while size - pos >= 9:
                length = int.from_bytes(buf[pos : pos + 3], "big")
                if length > http2.DEFAULT_MAX_FRAME:
                    raise _ConnectionError(http2.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > size:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : end])
                pos = end
                self._frame(kind, flags, sid, payload)
        except _ConnectionError as e:
            logger.debug("HTTP/2 connection error from %s: %s", self._peer, e)
            self._out += http2.goaway(self.highest_stream_id, e.code)
            self._flush()
            self.transport.close()
            return
        del buf[:pos]
        self._flush_soon()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        for call in list(self.calls.values()):
            call.peer_left()
        self.calls.clear()
        self._wake_all()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_all()

    def _close_on(self, why: str) -> None:
        logger.debug("closing the connection from %s: %s", self._peer, why)
        self.transport.close()

    # ---- frames ---------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._block is not None and kind != http2.CONTINUATION:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "a header block interrupted")
        if not self._settings_seen and kind != http2.SETTINGS:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "the preface's SETTINGS frame is missing")
        if kind == http2.DATA:
            self._data(flags, sid, payload)
        elif kind == http2.HEADERS:
            self._headers(flags, sid, payload)
        elif kind == http2.WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == http2.RST_STREAM:
            if len(payload) != 4:
                raise _ConnectionError(http2.FRAME_SIZE_ERROR, "RST_STREAM of a wrong size")
            if sid == 0 or sid > self.highest_stream_id:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            self._peer_left(sid)
        elif kind == http2.SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == http2.PING:
            if len(payload) != 8 or sid:
                raise _ConnectionError(http2.FRAME_SIZE_ERROR if sid == 0 else http2.PROTOCOL_ERROR, "a bad PING")
            if flags & http2.ACK:
                self._ping_outstanding = False
            else:
                self._out += http2.ping(payload, ack=True)
        elif kind == http2.CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == http2.GOAWAY:
            if sid:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "GOAWAY on a stream")
        elif kind == http2.PRIORITY:
            if sid == 0:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "PRIORITY on the connection")
        elif kind == http2.PUSH_PROMISE:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "a client may not push")
        # other frame types are ignored (RFC 9113 4.1)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & http2.ACK:
            if payload:
                raise _ConnectionError(http2.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(http2.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        self._settings_seen = True
        opened = False
        for i in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == http2.INITIAL_WINDOW_SIZE:
                if value > http2.MAX_WINDOW:
                    raise _ConnectionError(http2.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
                delta, self.initial_window = value - self.initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
                opened = opened or delta > 0
            elif key == http2.MAX_FRAME_SIZE:
                if not http2.DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                    raise _ConnectionError(http2.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                opened = opened or value > self.max_frame
                self.max_frame = value
            elif key == http2.HEADER_TABLE_SIZE:
                # no field of ours is ever indexed; a smaller table is still acknowledged (RFC 7541 4.2)
                if value < http2.DEFAULT_TABLE_SIZE:
                    self._table_update = http2.table_size_update(value)
            elif key == http2.ENABLE_PUSH and value > 1:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "ENABLE_PUSH other than 0 or 1")
        self._out += http2.SETTINGS_ACK
        if opened:
            self._window_opened(0)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(http2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > http2.MAX_WINDOW:
                raise _ConnectionError(http2.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            self._window_opened(0)
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self.highest_stream_id:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a stream that ended: updates may still be on their way
        call.send_window += increment
        if increment == 0 or call.send_window > http2.MAX_WINDOW:
            self._reset(call, http2.PROTOCOL_ERROR if increment == 0 else http2.FLOW_CONTROL_ERROR)
            return
        if call.pending:
            self.pump(call)

    # ---- requests -------------------------------------------------------------------------------
    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "HEADERS on the connection")
        start, end = 0, len(payload)
        if flags & http2.PADDED:
            if not payload or payload[0] >= end:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "padding longer than the frame")
            start, end = 1, end - payload[0]
        if flags & http2.PRIORITY_FLAG:
            start += 5
            if start > end:
                raise _ConnectionError(http2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
        block = payload[start:end]
        if flags & http2.END_HEADERS:
            self._header_block(sid, flags, block)
        else:
            self._block = (sid, flags, bytearray(block))

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._block is None or self._block[0] != sid:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block = self._block[2]
        block += payload
        if len(block) > _MAX_HEADER_BLOCK:
            raise _ConnectionError(http2.ENHANCE_YOUR_CALM, "a header block over 1 MB")
        if flags & http2.END_HEADERS:
            headers_flags = self._block[1]
            self._block = None
            self._header_block(sid, headers_flags, bytes(block))

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)  # always: the decoder's table is the client's
        except hpack.exceptions.HPACKError as e:
            raise _ConnectionError(http2.COMPRESSION_ERROR, f"a header block: {e}") from None
        call = self.calls.get(sid)
        if call is not None or sid <= self.highest_stream_id:  # trailers (gRPC clients send none)
            if call is None:  # a stream this server ended or refused: frames may still be on their way
                self._out += http2.rst_stream(sid, http2.STREAM_CLOSED)
                return
            if not flags & http2.END_STREAM or not call.remote_open:
                self._reset(call, http2.PROTOCOL_ERROR)
                return
            call.remote_open = False
            call.end_of_requests()
            return
        if sid % 2 == 0:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "a client's stream with an even id")
        self.highest_stream_id = sid
        if self.going_away:
            self._out += http2.rst_stream(sid, http2.REFUSED_STREAM)
            return
        problem = _request_problem(headers)
        if problem is not None:
            logger.debug("malformed request from %s: %s", self._peer, problem)
            self._out += http2.rst_stream(sid, http2.PROTOCOL_ERROR)
            return
        call = ServerCall(self, sid, headers, self._peer)
        call.send_window = self.initial_window
        self.calls[sid] = call
        call.start(self.server)
        if flags & http2.END_STREAM:
            call.remote_open = False
            call.end_of_requests()

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(http2.PROTOCOL_ERROR, "DATA on the connection")
        size = len(payload)  # what flow control counts: padding included
        self._receive_window -= size
        if self._receive_window < 0:
            raise _ConnectionError(http2.FLOW_CONTROL_ERROR, "DATA past the connection's window")
        if flags & http2.PADDED:
            if not payload or payload[0] >= size:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "padding longer than the frame")
            payload = payload[1 : size - payload[0]]
        call = self.calls.get(sid)
        if call is None or not call.remote_open:
            if sid > self.highest_stream_id:
                raise _ConnectionError(http2.PROTOCOL_ERROR, "DATA on an idle stream")
            self.acknowledge(sid, size)  # a stream that ended: its bytes still count on the connection
            if call is not None:
                self._reset(call, http2.STREAM_CLOSED)
            return
        call.receive_window -= size
        if call.receive_window < 0:
            self._reset(call, http2.FLOW_CONTROL_ERROR)
            return
        call.feed(payload, size, self.server.max_receive_bytes)
        if flags & http2.END_STREAM and call.remote_open:
            call.remote_open = False
            call.end_of_requests()

    def acknowledge(self, sid: int, size: int) -> None:
        """Request bytes read: the client may send as many more (HTTP/2 flow control), given back
        once half a window has been taken."""
        if not size:
            return
        self._taken += size
        if self._taken >= _RETURN_AT:
            self._out += http2.window_update(0, self._taken)
            self._receive_window += self._taken
            self._taken = 0
            self._flush_soon()
        call = self.calls.get(sid)
        if call is not None and call.remote_open:
            call.taken += size
            if call.taken >= _RETURN_AT:
                self._out += http2.window_update(sid, call.taken)
                call.receive_window += call.taken
                call.taken = 0
                self._flush_soon()

    def _peer_left(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            call.peer_left()

    def _reset(self, call: ServerCall, code: int) -> None:
        """A stream error: the stream is reset and its call cancelled."""
        self._out += http2.rst_stream(call.stream_id, code)
        self._peer_left(call.stream_id)
        self._flush_soon()

    # ---- keepalive ------------------------------------------------------------------------------
    def _arm_keepalive(self) -> None:
        """A PING every `keepalive_s`; a client that does not answer within `keepalive_timeout_s` is
        gone (a machine that vanished sends no FIN): its connection closes and its calls are
        cancelled, so their requests free what they hold upstream."""
        if self.server.keepalive_s:
            self._keepalive = self._loop.call_later(self.server.keepalive_s, self._ping)

    def _ping(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self._ping_outstanding = True
        self._out += http2.ping(b"keepaliv")
        self._flush()
        self._keepalive = self._loop.call_later(self.server.keepalive_timeout_s, self._check_ping)

    def _check_ping(self) -> None:
        if self._ping_outstanding:
            logger.info("gRPC client %s did not answer a keepalive ping: closing its connection", self._peer)
            self.transport.abort()
            return
        self._arm_keepalive()

    # ---- responses ----------------------------------------------------------------------------------
    def send_headers(self, call: ServerCall, block: bytes, end_stream: bool) -> None:
        """A header block (`http2.header_block`) on `call`'s stream."""
        if call.peer_gone or self.transport is None or self.transport.is_closing():
            return
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        self._out += http2.headers_frames(call.stream_id, block, end_stream, self.max_frame)
        self._flush_soon()

    def send_data(self, call: ServerCall, data: bytes) -> None:
        """`data` (framed messages) on `call`'s stream: now, or after what already waits."""
        if call.peer_gone:
            return
        if call.pending:
            call.pending += data
            return
        # `pump`'s common case written out: one small message a token, on windows with room
        n = len(data)
        if n <= self.send_window and n <= call.send_window and n <= self.max_frame:
            self.send_window -= n
            call.send_window -= n
            self._out += http2.data_frame(call.stream_id, data)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            return
        call.pending += data
        self.pump(call)

    def pump(self, call: ServerCall) -> None:
        """Send what of `call.pending` the windows let through, then its status if it waits."""
        pending = call.pending
        out = self._out
        while pending:
            n = min(len(pending), self.send_window, call.send_window, self.max_frame)
            if n <= 0:
                break
            out += http2.data_frame(call.stream_id, pending[:n])
            del pending[:n]
            self.send_window -= n
            call.send_window -= n
        if not pending:
            if call.trailers is not None:
                self._send_trailers(call)
            call.drained()
        self._flush_soon()

    def end_call(self, call: ServerCall) -> None:
        """The call's status is set (`call.trailers`): it goes once nothing waits before it."""
        if call.peer_gone:
            self.calls.pop(call.stream_id, None)
            return
        if not call.pending:
            self._send_trailers(call)

    def _send_trailers(self, call: ServerCall) -> None:
        trailers, call.trailers = call.trailers, None
        self.calls.pop(call.stream_id, None)
        if self.transport is None or self.transport.is_closing():
            return
        self.send_headers(call, trailers, end_stream=True)
        if call.remote_open:  # the client still sends: it is told to stop (gRPC's way)
            self._out += http2.rst_stream(call.stream_id, http2.NO_ERROR)

    def _window_opened(self, sid: int) -> None:
        if sid:
            call = self.calls.get(sid)
            if call is not None and call.pending:
                self.pump(call)
            return
        for call in list(self.calls.values()):
            if call.pending:
                self.pump(call)

    def _wake_all(self) -> None:
        for call in list(self.calls.values()):
            if not call.pending:
                call.drained()

    # ---- writing ----------------------------------------------------------------------------------
    def _flush_soon(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, bytearray()
            self.transport.write(out)

    def go_away(self) -> None:
        """Tell the client to open no new streams; those open finish."""
        if self.going_away or self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self._out += http2.goaway(self.highest_stream_id)
        self._flush()

    def close(self) -> None:
        for call in list(self.calls.values()):
            if call.task is not None and not call.task.done():
                call.task.cancel()
        if self.transport is not None:
            self._flush()
            self.transport.close()
