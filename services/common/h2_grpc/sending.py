"""What one end of an HTTP/2 connection writes (`peer.Http2Peer` is one): header blocks and DATA
within the peer's flow-control windows, resets, keepalive PINGs, and the coalesced write that
carries them.

A stream's bytes that do not fit the windows wait in the stream (`Stream.pending`) and go as the
peer opens them (`pump`). Everything sent while the event loop runs its ready callbacks leaves in
one `transport.write` at the end of them (`_flush`).
"""

from __future__ import annotations

import logging

from services.common.h2_grpc import http2
from services.common.h2_grpc.stream import Stream

logger = logging.getLogger(__name__)


class Sender:
    """The sending half of `Http2Peer`, which holds the state it uses (`_out`, the windows, the
    transport, the keepalive timers) and the hooks it calls (`_sent_all`, `_reset_sent`)."""

    def reset(self, call: Stream, code: int) -> None:
        """A stream error (or this end's cancel): the stream is reset and let go."""
        self._out += http2.rst_stream(call.stream_id, code)
        self._flush_soon()
        self._reset_sent(call, code)

    # ---- keepalive ------------------------------------------------------------------------------
    def _arm_keepalive(self) -> None:
        """A PING every `keepalive_s`; a peer that does not answer within `keepalive_timeout_s` is gone
        (a machine that vanished sends no FIN): the connection closes and its streams end."""
        if self._keepalive_s:
            self._keepalive = self._loop.call_later(self._keepalive_s, self._ping)

    def _ping(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if not self._keepalive_wanted():
            self._arm_keepalive()
            return
        self._ping_outstanding = True
        self._out += http2.ping(b"keepaliv")
        self._flush()
        self._keepalive = self._loop.call_later(self._keepalive_timeout_s, self._check_ping)

    def _check_ping(self) -> None:
        if self._ping_outstanding:
            logger.info("HTTP/2 peer %s did not answer a keepalive ping: closing the connection", self.peer_name)
            self.transport.abort()
            return
        self._arm_keepalive()

    # ---- streams ----------------------------------------------------------------------------------------
    def send_headers(self, call: Stream, block: bytes, end_stream: bool) -> None:
        """A header block (`http2.header_block`) on `call`'s stream."""
        if call.peer_gone or self.transport is None or self.transport.is_closing():
            return
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        self._out += http2.headers_frames(call.stream_id, block, end_stream, self.max_frame)
        self._flush_soon()

    def send_data(self, call: Stream, data: bytes) -> None:
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

    def pump(self, call: Stream) -> None:
        """Send what of `call.pending` the windows let through."""
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
            self._sent_all(call)
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
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, bytearray()
            self.transport.write(out)
