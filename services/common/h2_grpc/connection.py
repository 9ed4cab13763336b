"""One client connection of an `H2GrpcServer`: the server's end of HTTP/2 (`peer.py`), its streams
gRPC calls (`ServerCall`).

Beside what both ends share, the server checks the client's preface, opens a call for HEADERS on
each new odd stream id (the request's headers checked as RFC 9113 8.2-8.3 asks; refused past
GOAWAY), feeds it the DATA that follows, cancels it on RST_STREAM, and sends each call's status
once nothing waits before it.
"""

from __future__ import annotations

import logging
from typing import Optional

from services.common.h2_grpc import http2
from services.common.h2_grpc.call import ServerCall
from services.common.h2_grpc.peer import Http2Peer, ProtocolViolation

logger = logging.getLogger(__name__)

_CONNECTION_HEADERS = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))


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


class GrpcConnection(Http2Peer):
    calls: dict[int, ServerCall]

    def __init__(self, server):
        """`server`: the `H2GrpcServer` that accepted it (its methods, limits and keepalive)."""
        super().__init__(server.keepalive_s, server.keepalive_timeout_s)
        self.server = server
        self.going_away = False
        self.highest_stream_id = 0
        self._preface = True
        """The client's preface is still due."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        super().connection_lost(exc)

    def _preface_read(self, buf: bytearray) -> bool:
        if not self._preface:
            return True
        if len(buf) < len(http2.PREFACE):
            if not http2.PREFACE.startswith(buf):
                self._close_on("not an HTTP/2 client preface")
            return False
        if buf[: len(http2.PREFACE)] != http2.PREFACE:
            self._close_on("not an HTTP/2 client preface")
            return False
        del buf[: len(http2.PREFACE)]
        self._preface = False
        return True

    def _close_on(self, why: str) -> None:
        logger.debug("closing the connection from %s: %s", self.peer_name, why)
        self.transport.close()

    def _last_stream_id(self) -> int:
        return self.highest_stream_id

    # ---- requests -------------------------------------------------------------------------------
    def _header_block(self, sid: int, flags: int, headers: list) -> None:
        call = self.calls.get(sid)
        if call is not None or sid <= self.highest_stream_id:  # trailers (gRPC clients send none)
            if call is None:  # a stream this server ended or refused: frames may still be on their way
                self._out += http2.rst_stream(sid, http2.STREAM_CLOSED)
                return
            if not flags & http2.END_STREAM or not call.remote_open:
                self.reset(call, http2.PROTOCOL_ERROR)
                return
            call.remote_open = False
            call.end_of_requests()
            return
        if sid % 2 == 0:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "a client's stream with an even id")
        self.highest_stream_id = sid
        if self.going_away:
            self._out += http2.rst_stream(sid, http2.REFUSED_STREAM)
            return
        problem = _request_problem(headers)
        if problem is not None:
            logger.debug("malformed request from %s: %s", self.peer_name, problem)
            self._out += http2.rst_stream(sid, http2.PROTOCOL_ERROR)
            return
        call = ServerCall(self, sid, headers, self.peer_name)
        self.calls[sid] = call
        call.start(self.server)
        if flags & http2.END_STREAM:
            call.remote_open = False
            call.end_of_requests()

    def _stream_data(self, call: ServerCall, payload: bytes, size: int, end_stream: bool) -> None:
        call.feed(payload, size, self.server.max_receive_bytes)
        if end_stream:
            call.end_of_requests()

    def _data_on_unknown_stream(self, sid: int) -> None:
        if sid > self.highest_stream_id:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "DATA on an idle stream")

    def _stream_reset(self, sid: int, code: int) -> None:
        if sid > self.highest_stream_id:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        self._peer_left(sid)

    def _reset_sent(self, call: ServerCall, code: int) -> None:
        self._peer_left(call.stream_id)

    def _stream_lost(self, call: ServerCall) -> None:
        call.peer_left()

    def _peer_left(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            call.peer_left()

    # ---- responses ----------------------------------------------------------------------------------
    def _sent_all(self, call: ServerCall) -> None:
        if call.trailers is not None:
            self._send_trailers(call)
        call.drained()

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
