"""One HTTP/2 connection (RFC 9113) as gRPC uses it, either end: the frames read where they arrive,
the connection's own frames answered, flow control both ways, and writes coalesced. The server's
connection (`connection.py`) and the client's (`client.py`) add what streams mean to each.

Why its own: a general HTTP/2 library builds an object for every frame, event and header and
checks each on the way in and out; for a call of a few small messages that cost more than the
rest of the work on it. Here a frame is parsed where it arrives and acted on at once, and header
blocks are HPACK literals (`http2.py`) whose constant parts are made once.

What it keeps of the protocol, for both ends:
- SETTINGS (acknowledged; a new initial window moves every open stream's send window; the peer's
  maximum frame size bounds what is sent; a smaller header table is acknowledged);
- header blocks in HEADERS and CONTINUATION frames, padding and priority, decoded by
  `hpack.Decoder` (whose table is the peer encoder's);
- flow control: each stream's and the connection's receive windows (16 MB, returned in
  WINDOW_UPDATEs of half a window once the bytes were taken: `acknowledge`), and send windows that
  hold a stream's bytes back until the peer opens them (`pump`);
- PING (answered; ours are keepalives, and a peer that answers none within the timeout is gone);
- a connection error ends the connection with GOAWAY and its code; a stream error resets the stream.

What it writes, and how writes coalesce, is its sending half (`sending.py`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import hpack
import hpack.exceptions

from services.common.h2_grpc import http2
from services.common.h2_grpc.http2 import RECEIVE_WINDOW
from services.common.h2_grpc.sending import Sender
from services.common.h2_grpc.stream import Stream

logger = logging.getLogger(__name__)

_RETURN_AT = RECEIVE_WINDOW // 2
"""Bytes taken before they are given back in one WINDOW_UPDATE: a unary call sends none."""
_MAX_HEADER_BLOCK = 1 << 20
"""A header block split over CONTINUATION frames may grow this large (the decoded list is bounded
by the decoder's own limit)."""


class ProtocolViolation(Exception):
    """A connection error: the connection ends with GOAWAY and `code`."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


class Http2Peer(Sender, asyncio.Protocol):
    client_side = False

    def __init__(self, keepalive_s: float, keepalive_timeout_s: float):
        """`keepalive_s`: a PING this often (0: none), which must be answered within `keepalive_timeout_s`."""
        self.calls: dict[int, Stream] = {}
        self.transport: Optional[asyncio.Transport] = None
        self.paused = False
        """The socket's buffer is full (asyncio's write flow control): senders wait."""
        self.send_window = http2.DEFAULT_WINDOW
        """The connection's send window: what the peer takes of all streams' DATA before it opens it."""
        self.initial_window = http2.DEFAULT_WINDOW
        """Each new stream's send window (the peer's INITIAL_WINDOW_SIZE)."""
        self.max_frame = http2.DEFAULT_MAX_FRAME
        """The largest frame payload the peer takes."""
        self.peer_name = ""
        self._keepalive_s, self._keepalive_timeout_s = keepalive_s, keepalive_timeout_s
        self._out = bytearray()
        self._flush_scheduled = False
        self._in = bytearray()
        self._settings_seen = False
        self._decoder = hpack.Decoder()
        self._block: Optional[tuple[int, int, bytearray]] = None
        """A header block whose CONTINUATION frames are due: (stream id, HEADERS flags, block so far)."""
        self._receive_window = RECEIVE_WINDOW
        self._taken = 0
        """Received bytes taken, not yet given back to the peer's connection window."""
        self._table_update = b""
        """Prefixed to the next header block: the peer lowered HEADER_TABLE_SIZE."""
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
            self.peer_name = f"{family}:{peer[0]}:{peer[1]}"
        settings = {http2.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW}
        if self.client_side:
            self._out += http2.PREFACE
            settings[http2.ENABLE_PUSH] = 0
        else:
            settings[http2.MAX_CONCURRENT_STREAMS] = 2**31 - 1  # grpc's own server sets none
        self._out += http2.settings_frame(settings) + http2.window_update(0, RECEIVE_WINDOW - http2.DEFAULT_WINDOW)
        self._flush()
        self._arm_keepalive()

    def data_received(self, data: bytes) -> None:
        buf = self._in
        buf += data
        if not self._preface_read(buf):
            return
        pos, size = 0, len(buf)
        try:
            while size - pos >= 9:
                length = int.from_bytes(buf[pos : pos + 3], "big")
                if length > http2.DEFAULT_MAX_FRAME:
                    raise ProtocolViolation(http2.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > size:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : end])
                pos = end
                self._frame(kind, flags, sid, payload)
        except ProtocolViolation as e:
            logger.debug("HTTP/2 connection error from %s: %s", self.peer_name, e)
            self._out += http2.goaway(self._last_stream_id(), e.code)
            self._flush()
            self.transport.close()
            return
        del buf[:pos]
        self._flush_soon()

    def connection_lost(self, exc) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        for call in list(self.calls.values()):
            self._stream_lost(call)
        self.calls.clear()
        self._wake_all()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_all()

    # ---- what each end adds ---------------------------------------------------------------------------
    def _preface_read(self, buf: bytearray) -> bool:
        """Whether frames may be read from `buf` (the server first checks the client's preface)."""
        return True

    def _last_stream_id(self) -> int:
        """The last stream GOAWAY names as processed."""
        return 0

    def _header_block(self, sid: int, flags: int, headers: list) -> None:
        raise NotImplementedError

    def _stream_data(self, call: Stream, payload: bytes, size: int, end_stream: bool) -> None:
        raise NotImplementedError

    def _data_on_unknown_stream(self, sid: int) -> None:
        """DATA for a stream this end does not hold (one already ended is ignored)."""

    def _stream_reset(self, sid: int, code: int) -> None:
        """The peer reset stream `sid`."""
        raise NotImplementedError

    def _reset_sent(self, call: Stream, code: int) -> None:
        """This end reset `call`'s stream."""
        raise NotImplementedError

    def _stream_lost(self, call: Stream) -> None:
        """The connection went with `call` open."""
        raise NotImplementedError

    def _go_away_received(self, last_stream_id: int, code: int) -> None:
        """The peer sent GOAWAY."""

    def _keepalive_wanted(self) -> bool:
        """Whether to PING now (a client pings only while it has calls open, as grpc's clients do:
        a server may take pings on an idle connection for abuse)."""
        return True

    def _sent_all(self, call: Stream) -> None:
        """`call.pending` went out."""
        call.drained()

    # ---- frames ---------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._block is not None and kind != http2.CONTINUATION:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "a header block interrupted")
        if not self._settings_seen and kind != http2.SETTINGS:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "the preface's SETTINGS frame is missing")
        if kind == http2.DATA:
            self._data(flags, sid, payload)
        elif kind == http2.HEADERS:
            self._headers(flags, sid, payload)
        elif kind == http2.WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == http2.RST_STREAM:
            if len(payload) != 4:
                raise ProtocolViolation(http2.FRAME_SIZE_ERROR, "RST_STREAM of a wrong size")
            if sid == 0:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "RST_STREAM on the connection")
            self._stream_reset(sid, int.from_bytes(payload, "big"))
        elif kind == http2.SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == http2.PING:
            if len(payload) != 8 or sid:
                raise ProtocolViolation(http2.FRAME_SIZE_ERROR if sid == 0 else http2.PROTOCOL_ERROR, "a bad PING")
            if flags & http2.ACK:
                self._ping_outstanding = False
            else:
                self._out += http2.ping(payload, ack=True)
        elif kind == http2.CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == http2.GOAWAY:
            if sid or len(payload) < 8:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "a bad GOAWAY")
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self._go_away_received(last, int.from_bytes(payload[4:8], "big"))
        elif kind == http2.PRIORITY:
            if sid == 0:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "PRIORITY on the connection")
        elif kind == http2.PUSH_PROMISE:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "PUSH_PROMISE: push is off")
        # other frame types are ignored (RFC 9113 4.1)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & http2.ACK:
            if payload:
                raise ProtocolViolation(http2.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolViolation(http2.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        self._settings_seen = True
        opened = False
        for i in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == http2.INITIAL_WINDOW_SIZE:
                if value > http2.MAX_WINDOW:
                    raise ProtocolViolation(http2.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
                delta, self.initial_window = value - self.initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
                opened = opened or delta > 0
            elif key == http2.MAX_FRAME_SIZE:
                if not http2.DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolViolation(http2.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                opened = opened or value > self.max_frame
                self.max_frame = value
            elif key == http2.HEADER_TABLE_SIZE:
                # no field of ours is ever indexed; a smaller table is still acknowledged (RFC 7541 4.2)
                if value < http2.DEFAULT_TABLE_SIZE:
                    self._table_update = http2.table_size_update(value)
            elif key == http2.ENABLE_PUSH and value > 1:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "ENABLE_PUSH other than 0 or 1")
        self._out += http2.SETTINGS_ACK
        if opened:
            self._window_opened(0)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(http2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > http2.MAX_WINDOW:
                raise ProtocolViolation(http2.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            self._window_opened(0)
            return
        call = self.calls.get(sid)
        if call is None:
            return  # a stream that ended: updates may still be on their way
        call.send_window += increment
        if increment == 0 or call.send_window > http2.MAX_WINDOW:
            self.reset(call, http2.PROTOCOL_ERROR if increment == 0 else http2.FLOW_CONTROL_ERROR)
            return
        if call.pending:
            self.pump(call)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "HEADERS on the connection")
        start, end = 0, len(payload)
        if flags & http2.PADDED:
            if not payload or payload[0] >= end:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "padding longer than the frame")
            start, end = 1, end - payload[0]
        if flags & http2.PRIORITY_FLAG:
            start += 5
            if start > end:
                raise ProtocolViolation(http2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
        block = payload[start:end]
        if flags & http2.END_HEADERS:
            self._decoded(sid, flags, block)
        else:
            self._block = (sid, flags, bytearray(block))

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._block is None or self._block[0] != sid:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block = self._block[2]
        block += payload
        if len(block) > _MAX_HEADER_BLOCK:
            raise ProtocolViolation(http2.ENHANCE_YOUR_CALM, "a header block over 1 MB")
        if flags & http2.END_HEADERS:
            headers_flags = self._block[1]
            self._block = None
            self._decoded(sid, headers_flags, bytes(block))

    def _decoded(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)  # always: the decoder's table is the peer's
        except hpack.exceptions.HPACKError as e:
            raise ProtocolViolation(http2.COMPRESSION_ERROR, f"a header block: {e}") from None
        self._header_block(sid, flags, headers)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolViolation(http2.PROTOCOL_ERROR, "DATA on the connection")
        size = len(payload)  # what flow control counts: padding included
        self._receive_window -= size
        if self._receive_window < 0:
            raise ProtocolViolation(http2.FLOW_CONTROL_ERROR, "DATA past the connection's window")
        if flags & http2.PADDED:
            if not payload or payload[0] >= size:
                raise ProtocolViolation(http2.PROTOCOL_ERROR, "padding longer than the frame")
            payload = payload[1 : size - payload[0]]
        call = self.calls.get(sid)
        if call is None or not call.remote_open:
            self._data_on_unknown_stream(sid)
            self.acknowledge(sid, size)  # a stream that ended: its bytes still count on the connection
            if call is not None:
                self.reset(call, http2.STREAM_CLOSED)
            return
        call.receive_window -= size
        if call.receive_window < 0:
            self.reset(call, http2.FLOW_CONTROL_ERROR)
            return
        end_stream = bool(flags & http2.END_STREAM)
        if end_stream:
            call.remote_open = False
        self._stream_data(call, payload, size, end_stream)

    def acknowledge(self, sid: int, size: int) -> None:
        """Received bytes taken: the peer may send as many more (HTTP/2 flow control), given back
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
