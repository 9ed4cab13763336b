"""`H2Channel`: a gRPC client on the package's HTTP/2 (`peer.py`), for the calls a router makes per
request and per engine step: a subscription's stream of `DeltaBatch`es, and the `SubmitBatch`
calls that start requests.

Why: through `grpc.aio` a unary call costs its caller ~390 µs of CPU on the 2-core machine and
each message of a stream ~100 µs (a batch operation, a completion-queue event, a hand-off between
grpc's thread and the event loop), which at 64-token requests was a sixth of the head's CPU. Here
a call is a HEADERS frame of constant literals plus its message, and a streamed message a DATA
frame parsed where it arrives.

The calls fail as `grpc.aio`'s do, with `grpc.aio.AioRpcError` (the status, its details, the
metadata), so their callers read both alike: UNAVAILABLE when the connection cannot be made or is
lost, DEADLINE_EXCEEDED past a timeout (the stream is reset), CANCELLED for a call cancelled here.
One connection a channel, opened on the first call and again after it was lost or told to go
away; keepalive PINGs find a peer that vanished. Unary-unary and unary-stream methods only;
requests are not compressed and responses may be (gzip, deflate).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Optional

import grpc

from services.common.h2_grpc import http2, wire
from services.common.h2_grpc.client_call import ClientCall, rpc_error
from services.common.h2_grpc.peer import Http2Peer
from services.common.h2_grpc.stream import wake

_REQUEST_TAIL = http2.header_block(
    [
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"grpc-accept-encoding", b"identity"),
        (b"user-agent", b"deepinfer-h2-grpc"),
    ]
)


def _timeout_header(timeout: float) -> bytes:
    ms = max(1, int(timeout * 1000))
    return b"%dm" % ms if ms < 10**8 else b"%dS" % min(timeout, 10**8 - 1)


_RESET_STATUS = {http2.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE, http2.CANCEL: grpc.StatusCode.CANCELLED}
"""A stream the server reset, as the call's status (any other code: INTERNAL)."""


class ClientConnection(Http2Peer):
    client_side = True
    calls: dict[int, ClientCall]

    def __init__(self, authority: bytes, keepalive_s: float, keepalive_timeout_s: float):
        super().__init__(keepalive_s, keepalive_timeout_s)
        self.authority = authority
        self.usable = True
        """New calls may start here (not told to go away, not lost, stream ids left)."""
        self.lost = asyncio.get_running_loop().create_future()
        self._next_id = 1

    def start_call(self, path: bytes, payload: bytes, timeout: Optional[float], metadata, limit: int) -> ClientCall:
        sid = self._next_id
        self._next_id += 2
        if self._next_id > 2**31 - 1:
            self.usable = False
        call = ClientCall(self, sid, limit)
        self.calls[sid] = call
        head = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", self.authority)]
        block = http2.header_block(head) + _REQUEST_TAIL
        if timeout is not None:
            block += http2.literal(b"grpc-timeout", _timeout_header(timeout))
            call.expire_at(timeout)
        if metadata:
            block += http2.header_block(wire.header_pairs(metadata))
        self.send_headers(call, block, end_stream=False)
        self.send_data(call, wire.message(payload))
        if call.pending:
            call.end_after_pending = True
        else:
            self._out += http2.frame(http2.DATA, http2.END_STREAM, sid)
        return call

    def _sent_all(self, call: ClientCall) -> None:
        if call.end_after_pending:
            call.end_after_pending = False
            self._out += http2.frame(http2.DATA, http2.END_STREAM, call.stream_id)

    def _header_block(self, sid: int, flags: int, headers: list) -> None:
        call = self.calls.get(sid)
        if call is not None:
            call.on_headers(headers, bool(flags & http2.END_STREAM))

    def _stream_data(self, call: ClientCall, payload: bytes, size: int, end_stream: bool) -> None:
        self.acknowledge(call.stream_id, size)  # its reader takes messages as they come
        call.on_data(payload)
        if end_stream and call.status is None:
            call.finish(grpc.StatusCode.INTERNAL, "the stream ended without a status")

    def _stream_reset(self, sid: int, code: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            status = _RESET_STATUS.get(code, grpc.StatusCode.INTERNAL)
            call.finish(status, f"the server reset the stream (HTTP/2 error {code})")

    def _reset_sent(self, call: ClientCall, code: int) -> None:
        self.calls.pop(call.stream_id, None)
        call.finish(grpc.StatusCode.INTERNAL, f"the stream was reset (HTTP/2 error {code})")

    def _stream_lost(self, call: ClientCall) -> None:
        call.finish(grpc.StatusCode.UNAVAILABLE, "the connection was lost")

    def _keepalive_wanted(self) -> bool:
        return bool(self.calls)

    def _go_away_received(self, last_stream_id: int, code: int) -> None:
        self.usable = False
        for sid, call in list(self.calls.items()):
            if sid > last_stream_id:
                call.finish(grpc.StatusCode.UNAVAILABLE, "the server went away before the call began")
        if not self.calls and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.usable = False
        super().connection_lost(exc)
        wake(self.lost)


class H2Channel:
    def __init__(self, address: str, max_receive_bytes: int = 4 * 1024 * 1024, keepalive_s: float = 20.0,
                 keepalive_timeout_s: float = 10.0):  # fmt: skip
        """`address`: host:port (an IPv6 host in brackets)."""
        self.address = address
        self.max_receive_bytes = max_receive_bytes
        self._keepalive = (keepalive_s, keepalive_timeout_s)
        self._conn: Optional[ClientConnection] = None
        self._connecting: Optional[asyncio.Future] = None
        self._closed = False

    async def connection(self) -> ClientConnection:
        """The channel's connection, made (or made again) if need be; raises UNAVAILABLE when it cannot be."""
        if self._closed:
            raise grpc.aio.UsageError("the channel is closed")
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> ClientConnection:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: ClientConnection(self.address.encode(), *self._keepalive), host.strip("[]"), int(port)
            )
        except (OSError, ValueError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self.address}: {e}") from None
        if self._closed:  # closed while it connected
            conn.transport.close()
            raise grpc.aio.UsageError("the channel is closed")
        self._conn = conn
        return conn

    def unary_unary(self, method: str, request_serializer=None, response_deserializer=None) -> Callable:
        """As `grpc.aio.Channel.unary_unary`: a callable `(request, *, timeout, metadata)` whose
        result is awaited for the response."""
        path = method.encode()

        async def call(request, *, timeout: Optional[float] = None, metadata=None):
            payload = request_serializer(request) if request_serializer is not None else request
            started = (await self.connection()).start_call(path, payload, timeout, metadata, self.max_receive_bytes)
            try:
                reply = await started.next_message()
                if reply is None:
                    raise rpc_error(grpc.StatusCode.INTERNAL, "the call ended without its response message")
                if await started.next_message() is not None:
                    raise rpc_error(grpc.StatusCode.INTERNAL, "a unary call answered with several messages")
            except asyncio.CancelledError:
                started.cancel()
                raise
            return response_deserializer(reply) if response_deserializer is not None else reply

        return call

    def unary_stream(self, method: str, request_serializer=None, response_deserializer=None) -> Callable:
        """As `grpc.aio.Channel.unary_stream`: a callable `(request, *, timeout, metadata)` that
        returns the call (`StreamCall`) at once."""
        path = method.encode()

        def call(request, *, timeout: Optional[float] = None, metadata=None) -> StreamCall:
            payload = request_serializer(request) if request_serializer is not None else request
            return StreamCall(self, path, payload, timeout, metadata, response_deserializer)

        return call

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
            await asyncio.wait({self._conn.lost}, timeout=5.0)


class StreamCall:
    """A server-streaming call as `grpc.aio`'s reads: `initial_metadata()`, `async for` over its
    messages, `done()`, `cancel()`, `code()`, `details()`, `trailing_metadata()`."""

    def __init__(self, channel: H2Channel, path: bytes, payload: bytes, timeout, metadata, deserialize):
        self._deserialize = deserialize
        self._call: Optional[ClientCall] = None
        self._failed: Optional[grpc.aio.AioRpcError] = None
        self._cancelled = False
        self._opened = asyncio.ensure_future(self._open(channel, path, payload, timeout, metadata))

    async def _open(self, channel, path, payload, timeout, metadata) -> None:
        try:
            conn = await channel.connection()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            self._failed = e if isinstance(e, grpc.aio.AioRpcError) else rpc_error(grpc.StatusCode.UNAVAILABLE, str(e))
            return
        self._call = conn.start_call(path, payload, timeout, metadata, channel.max_receive_bytes)
        if self._cancelled:
            self._call.cancel()

    async def _started(self) -> Optional[ClientCall]:
        await asyncio.shield(self._opened)
        return self._call

    async def initial_metadata(self) -> grpc.aio.Metadata:
        call = await self._started()
        if call is None:
            return grpc.aio.Metadata()
        await asyncio.shield(call.headers_arrived)
        return grpc.aio.Metadata(*call.initial)

    def done(self) -> bool:
        if self._failed is not None:
            return True
        return self._call is not None and self._call.status is not None

    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        return True

    def _status(self) -> tuple:
        if self._failed is not None:
            return self._failed.code(), self._failed.details(), ()
        if self._call is None or self._call.status is None:
            return None, None, ()
        return self._call.status

    async def code(self) -> grpc.StatusCode:
        await self._ended()
        return self._status()[0]

    async def details(self) -> str:
        await self._ended()
        return self._status()[1]

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await self._ended()
        return grpc.aio.Metadata(*self._status()[2])

    async def _ended(self) -> None:
        call = await self._started()
        if call is not None:
            await asyncio.shield(call.ended)

    async def _messages(self):
        call = await self._started()
        if call is None:
            raise self._failed
        deserialize = self._deserialize
        try:
            while (message := await call.next_message()) is not None:
                yield deserialize(message) if deserialize is not None else message
        except asyncio.CancelledError:
            call.cancel()
            raise

    def __aiter__(self):
        return self._messages()
