"""One call of an `H2Channel` (`client.py`): its stream's response headers, messages and status as
they arrive, and what its caller awaits (`next_message`). A failed call raises what `grpc.aio`'s
would: `grpc.aio.AioRpcError` with the status, its details and the metadata."""

from __future__ import annotations

import asyncio
import urllib.parse
from collections import deque
from typing import Optional

import grpc

from services.common.h2_grpc import http2, wire
from services.common.h2_grpc.stream import Stream, wake

_CODES = {status.value[0]: status for status in grpc.StatusCode}
_S = grpc.StatusCode
_HTTP_STATUS = {400: _S.INTERNAL, 401: _S.UNAUTHENTICATED, 403: _S.PERMISSION_DENIED, 404: _S.UNIMPLEMENTED}
_HTTP_STATUS.update({429: _S.UNAVAILABLE, 502: _S.UNAVAILABLE, 503: _S.UNAVAILABLE, 504: _S.UNAVAILABLE})
"""How a response that is not gRPC's maps to a status (gRPC's HTTP-to-status table)."""


def rpc_error(code: grpc.StatusCode, details: str, initial=(), trailing=()) -> grpc.aio.AioRpcError:
    """A failed call as `grpc.aio` raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(*initial), grpc.aio.Metadata(*trailing), details)


class ClientCall(Stream):
    """One call's stream: its response headers, messages and status as they arrive."""

    def __init__(self, conn, stream_id: int, limit: int):
        """`conn`: the `ClientConnection` the call goes on."""
        super().__init__(stream_id, conn.initial_window)
        self.conn = conn
        self.limit = limit
        self.initial: tuple = ()
        self.status: Optional[tuple[grpc.StatusCode, str, tuple]] = None
        """(code, details, trailing metadata) once the call ended."""
        self.end_after_pending = False
        """The request's END_STREAM waits for `pending` to go out."""
        self._headers_seen = False
        self._encoding = "identity"
        self._messages: deque = deque()
        self._buffer = bytearray()
        self._waiter: Optional[asyncio.Future] = None
        loop = asyncio.get_running_loop()
        self.headers_arrived = loop.create_future()
        """Resolved once the response's headers came, or the call ended."""
        self.ended = loop.create_future()
        """Resolved once the call ended (`status`)."""
        self._deadline = None

    # ---- from the connection --------------------------------------------------------------------
    def on_headers(self, headers: list, end_stream: bool) -> None:
        fields = dict(headers)
        if not self._headers_seen:
            self._headers_seen = True
            status = fields.get(b":status", b"")
            if status != b"200":
                code = _HTTP_STATUS.get(int(status or 0), grpc.StatusCode.UNKNOWN)
                return self.finish(code, f"the server answered HTTP status {status.decode() or '(none)'}")
            if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
                return self.finish(grpc.StatusCode.UNKNOWN, "the server's response is not gRPC")
            self._encoding = fields.get(b"grpc-encoding", b"identity").decode("ascii", "replace")
            self.initial = wire.metadata_of(headers)
            if not end_stream:
                wake(self.headers_arrived)
                return
        elif not end_stream:
            return self.finish(grpc.StatusCode.INTERNAL, "trailers without END_STREAM")
        value = fields.get(b"grpc-status")
        if value is None:
            return self.finish(grpc.StatusCode.UNKNOWN, "the server sent no status")
        details = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("ascii", "replace"))
        code = _CODES.get(int(value), grpc.StatusCode.UNKNOWN) if value.isdigit() else grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.OK and self._buffer:
            code, details = grpc.StatusCode.INTERNAL, "the stream ended inside a message"
        self.finish(code, details, wire.metadata_of(headers))

    def on_data(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._messages.extend(wire.take_messages(self._buffer, self._encoding, self.limit))
        except wire.MessageTooLarge as e:
            return self.cancel(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            return self.cancel(grpc.StatusCode.INTERNAL, f"a compressed response message: {e}")
        self._wake()

    def finish(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        if self.status is not None:
            return
        self.status = (code, details, trailing)
        conn = self.conn
        conn.calls.pop(self.stream_id, None)
        if self._deadline is not None:
            self._deadline.cancel()
        wake(self.headers_arrived)
        wake(self.ended)
        self._wake()
        if not conn.usable and not conn.calls and conn.transport is not None:
            conn.transport.close()  # told to go away (or out of stream ids), and its last call is over

    def expire_at(self, timeout: float) -> None:
        self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self.status is None:
            self.cancel(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def cancel(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, details: str = "Locally cancelled") -> None:
        """End the call with `code`, and reset its stream (CANCEL) so that the server lets it go."""
        if self.status is None:
            self.finish(code, details)
            self.conn.reset(self, http2.CANCEL)

    # ---- for the caller -------------------------------------------------------------------------
    async def next_message(self) -> Optional[bytes]:
        """The next response message; None once the call ended OK; raises its failure."""
        while not self._messages:
            if self.status is not None:
                code, details, trailing = self.status
                if code == grpc.StatusCode.OK:
                    return None
                raise rpc_error(code, details, self.initial, trailing)
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._messages.popleft()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        wake(waiter)
