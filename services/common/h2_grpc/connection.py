"""One client connection of an `H2GrpcServer`: HTTP/2 through the `h2` state machine, except the
DATA frames of response messages, which are written here directly.

Why directly: `h2` builds a frame object for each send, which for a stream of small messages costs
more than everything else the server does for one. A message that fits the peer's maximum frame
size and both flow-control windows (the connection's and its stream's) becomes one DATA frame, and
the windows `h2` keeps are lowered by its size exactly as `H2Connection.send_data` would, so `h2`'s
accounting stays the peer's. A message that does not fit waits in its call (`ServerCall.pending`)
and goes, in frames that fit, as the peer's WINDOW_UPDATEs come (`pump`).

Writes coalesce: everything sent while the event loop runs its ready callbacks (the messages of
many streams, `h2`'s own frames, in order) leaves in one `transport.write` at the end of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from services.common.h2_grpc import wire
from services.common.h2_grpc.call import ServerCall

logger = logging.getLogger(__name__)

_RECEIVE_WINDOW = 1 << 24
"""The connection's and each stream's receive window (a request message is bounded by the server's
size limit; a stream's messages are acknowledged as they arrive while few wait: `ServerCall.feed`)."""
_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=True,
    # the server's own headers: constant names and values, and metadata keys made lowercase
    # (`wire.header_pairs`); checking each again cost more than the rest of sending them
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)
_CULL_EVERY = 64


class _H2Connection(h2.connection.H2Connection):
    """`h2`'s connection, less its count of the open streams each time the peer opens one: a scan of
    every stream the connection holds, which with a thousand streams on one connection was the
    largest cost of starting a call. The count only guards MAX_CONCURRENT_STREAMS, which this
    server leaves unbounded; the scan also drops closed streams, so it still runs every
    `_CULL_EVERY` new streams (the streams held stay bounded)."""

    _opened = 0

    def _open_streams(self, remainder: int) -> int:
        self._opened += 1
        if self._opened % _CULL_EVERY:
            return 0  # within the limit the server advertises (2**31 - 1) whatever the count
        return super()._open_streams(remainder)


class GrpcConnection(asyncio.Protocol):
    def __init__(self, server):
        """`server`: the `H2GrpcServer` that accepted it (its methods, limits and keepalive)."""
        self.server = server
        self.h2 = _H2Connection(config=_CONFIG)
        self.calls: dict[int, ServerCall] = {}
        self.transport: Optional[asyncio.Transport] = None
        self.paused = False
        """The socket's buffer is full (asyncio's write flow control): handlers wait."""
        self.going_away = False
        self._out = bytearray()
        self._flush_scheduled = False
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
        h2c = self.h2
        h2c.initiate_connection()
        h2c.update_settings(
            {
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1,  # grpc's own server sets none
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _RECEIVE_WINDOW,
            }
        )
        h2c.increment_flow_control_window(_RECEIVE_WINDOW - 65535)
        self._flush()
        self._arm_keepalive()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            logger.debug("HTTP/2 protocol error from %s: %s", self._peer, e)
            self._flush()
            self.transport.close()
            return
        for event in events:
            kind = type(event)
            if kind is h2.events.DataReceived:
                self._data(event)
            elif kind is h2.events.RequestReceived:
                self._request(event)
            elif kind is h2.events.StreamEnded:
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call.end_of_requests()
            elif kind is h2.events.WindowUpdated:
                self._window_opened(event.stream_id)
            elif kind is h2.events.RemoteSettingsChanged:
                self._window_opened(0)  # a larger initial window, or maximum frame size
            elif kind is h2.events.StreamReset:
                self._peer_left(event.stream_id)
            elif kind is h2.events.PingAckReceived:
                self._ping_outstanding = False
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
        self.h2.ping(b"keepaliv")
        self._flush()
        self._keepalive = self._loop.call_later(self.server.keepalive_timeout_s, self._check_ping)

    def _check_ping(self) -> None:
        if self._ping_outstanding:
            logger.info("gRPC client %s did not answer a keepalive ping: closing its connection", self._peer)
            self.transport.abort()
            return
        self._arm_keepalive()

    # ---- requests ---------------------------------------------------------------------------------
    def _request(self, event) -> None:
        sid = event.stream_id
        if self.going_away:
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        call = ServerCall(self, sid, event.headers, self._peer)
        self.calls[sid] = call
        call.start(self.server.lookup(call.method, call.metadata))

    def _data(self, event) -> None:
        call = self.calls.get(event.stream_id)
        if call is None:
            self.acknowledge(event.stream_id, event.flow_controlled_length)
        else:
            call.feed(event.data, event.flow_controlled_length, self.server.max_receive_bytes)

    def acknowledge(self, sid: int, size: int) -> None:
        """Request bytes read: the client may send as many more (HTTP/2 flow control)."""
        if size:
            try:
                self.h2.acknowledge_received_data(size, sid)
            except h2.exceptions.StreamClosedError:
                pass
            self._flush_soon()

    def _peer_left(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            call.peer_left()

    # ---- responses ----------------------------------------------------------------------------------
    def send_headers(self, call: ServerCall, headers: list, end_stream: bool) -> None:
        if call.peer_gone or self.transport is None or self.transport.is_closing():
            return
        try:
            self.h2.send_headers(call.stream_id, headers, end_stream=end_stream)
        except h2.exceptions.StreamClosedError:
            return
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
        h2c = self.h2
        stream = call.h2_stream
        if n <= h2c.outbound_flow_control_window and n <= stream.outbound_flow_control_window:
            if n <= h2c.max_outbound_frame_size:
                h2c.outbound_flow_control_window -= n
                stream.outbound_flow_control_window -= n
                out = self._out
                pending = h2c.data_to_send()
                if pending:
                    out += pending  # h2's frames before ours (this stream's HEADERS, at least)
                out += wire.data_frame(call.stream_id, data)
                if not self._flush_scheduled:
                    self._flush_scheduled = True
                    self._loop.call_soon(self._flush)
                return
        call.pending += data
        self.pump(call)

    def pump(self, call: ServerCall) -> None:
        """Send what of `call.pending` the windows let through, then its status if it waits."""
        h2c = self.h2
        pending = call.pending
        stream = call.h2_stream
        out = self._out
        queued = h2c.data_to_send()
        if queued:
            out += queued
        while pending:
            n = min(len(pending), h2c.outbound_flow_control_window, stream.outbound_flow_control_window)
            n = min(n, h2c.max_outbound_frame_size)
            if n <= 0:
                break
            out += wire.data_frame(call.stream_id, pending[:n])
            del pending[:n]
            h2c.outbound_flow_control_window -= n
            stream.outbound_flow_control_window -= n
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
        try:
            self.h2.send_headers(call.stream_id, trailers, end_stream=True)
            if call.h2_stream.open:  # the client still sends: it is told to stop (gRPC's way)
                self.h2.reset_stream(call.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.StreamClosedError:
            pass
        self._flush_soon()

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
        pending = self.h2.data_to_send()
        if pending:
            self._out += pending
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, bytearray()
            self.transport.write(out)

    def go_away(self) -> None:
        """Tell the client to open no new streams; those open finish."""
        if self.going_away or self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self._flush()
        self.transport.write(wire.goaway_frame(self.h2.highest_inbound_stream_id))

    def close(self) -> None:
        for call in list(self.calls.values()):
            if call.task is not None and not call.task.done():
                call.task.cancel()
        if self.transport is not None:
            self._flush()
            self.transport.close()
