"""One gRPC call on an `H2GrpcServer`: its request messages, its handler's task, and the servicer
context the handler sees (the `grpc.aio.ServicerContext` methods the services use).

The handler runs as a task of its own from the request's headers on. Its messages go to the
connection as they are made (`GrpcConnection.send_data`); while the client's flow-control window or
the socket holds them back, the handler waits (`_drain`), so a client that does not read stops its
handler, as grpc's own server does. A fast lane may hand the call a serialized message directly
(`send_now`), only while nothing waits before it (`can_send_now`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from typing import Optional

import grpc

from services.common.h2_grpc import http2, wire
from services.common.h2_grpc.stream import Stream, wake

logger = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_BURST = 32
"""Messages a handler may send in a row without the event loop running in between."""
_QUEUED_REQUESTS = 8
"""Request messages that may wait for the handler before the client's window stops it."""
_CONTENT_TYPE = http2.literal(b"content-type", b"application/grpc")
_HEAD = http2.STATUS_200 + _CONTENT_TYPE + http2.literal(b"grpc-accept-encoding", wire.ACCEPT_ENCODING.encode())
"""A response's HEADERS without metadata: the same bytes every time."""
_TRAILERS_ONLY_HEAD = http2.STATUS_200 + _CONTENT_TYPE
_STATUS = {code: http2.literal(b"grpc-status", str(code.value[0]).encode()) for code in grpc.StatusCode}


class _Status(Exception):
    """Ends the call with a status the server chose (a malformed request, a message too large)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details


class ServerCall(Stream):
    def __init__(self, conn, stream_id: int, headers: list, peer: str):
        """`conn`: the `GrpcConnection` the call came on."""
        super().__init__(stream_id, conn.initial_window)
        self.conn = conn
        fields = {}
        for key, value in headers:
            if key[:1] == b":" or key in (b"content-type", b"grpc-timeout", b"grpc-encoding"):
                fields[key] = value.decode("ascii", "replace")
        self.method = fields.get(b":path", "")
        self._http_method = fields.get(b":method", "")
        self._content_type = fields.get(b"content-type", "")
        self.encoding = fields.get(b"grpc-encoding", "identity")
        self._timeout = wire.timeout_s(fields[b"grpc-timeout"]) if b"grpc-timeout" in fields else None
        self.metadata = wire.metadata_of(headers)
        self._peer = peer
        self.trailers: Optional[bytes] = None
        """The status's header block, waiting for `pending` to go out first."""
        self.headers_sent = False
        self.closed = False
        """The status went (or is waiting behind `pending`), or the stream was reset."""
        self._requests: deque = deque()
        self._buffer = bytearray()
        self._unacknowledged = 0
        self._request_ended = False
        self._reader: Optional[asyncio.Future] = None
        self._drained: Optional[asyncio.Future] = None
        self._deadline_timer = None
        self._expired = False
        self._code: Optional[grpc.StatusCode] = None
        self._details: Optional[str] = None
        self._trailing = ()
        self._serialize = None
        self._burst = 0
        self._done_callbacks: list = []
        self.task: Optional[asyncio.Task] = None

    # ---- from the connection --------------------------------------------------------------------
    def start(self, server) -> None:
        """Run the method's handler (`server`: the `H2GrpcServer`, which finds it), or refuse the call."""
        if self._http_method != "POST" or not self._content_type.startswith("application/grpc"):
            return self._finish(grpc.StatusCode.INTERNAL, "not a gRPC request (POST, content-type application/grpc)")
        loop = asyncio.get_running_loop()
        if server.interceptors:
            handler = server.resolve(self.method, self.metadata)  # awaited in the call's task
        else:
            handler = server.lookup(self.method, self.metadata)
            if handler is None:
                return self._finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {self.method}")
        if self._timeout is not None:
            self._deadline_timer = loop.call_later(self._timeout, self._expire)
        self.task = loop.create_task(self._run(handler))

    def feed(self, data: bytes, flow_controlled: int, limit: int) -> None:
        """Request bytes: complete messages go to the handler; one over `limit` fails the call. They
        are acknowledged while few messages wait for the handler, else once it reads them: a client
        streaming faster than its handler reads is held by its window."""
        if len(self._requests) < _QUEUED_REQUESTS or self.closed:
            self.conn.acknowledge(self.stream_id, flow_controlled)
        else:
            self._unacknowledged += flow_controlled
        if self.closed:
            return
        self._buffer += data
        try:
            self._requests.extend(wire.take_messages(self._buffer, self.encoding, limit))
        except wire.MessageTooLarge as e:
            return self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            return self._fail(grpc.StatusCode.INTERNAL, f"a compressed request message: {e}")
        self._wake_reader()

    def end_of_requests(self) -> None:
        self._request_ended = True
        if self._buffer and not self.closed:
            return self._fail(grpc.StatusCode.INTERNAL, "the request ended inside a message")
        self._wake_reader()

    def peer_left(self) -> None:
        """The client reset the stream, or the connection went: nothing more goes to it."""
        self.peer_gone = self.closed = True
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._cancel_timer()

    def drained(self) -> None:
        """What waited for the client's windows or the socket went out."""
        waiter, self._drained = self._drained, None
        wake(waiter)

    # ---- the handler ----------------------------------------------------------------------------
    async def _run(self, handler) -> None:
        """`handler`: the method's, or an awaitable of it (the interceptors' verdict)."""
        code, details = _OK, ""
        try:
            if inspect.isawaitable(handler):
                handler = await handler
                if handler is None:
                    raise _Status(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {self.method}")
            await self._serve(handler)
            code, details = self._code or _OK, self._details or ""
        except grpc.aio.AbortError:
            code, details = self._code, self._details or ""
        except _Status as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            if self.peer_gone:
                return
            if self._expired:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:  # the server stops
                code, details = grpc.StatusCode.UNAVAILABLE, "the server is shutting down"
        except Exception as e:  # noqa: BLE001 - the handler's failure becomes the call's status
            if self._code not in (None, _OK):
                code, details = self._code, self._details or ""
            else:
                logger.exception("gRPC method %s failed", self.method)
                code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            self._cancel_timer()
            for callback in self._done_callbacks:
                callback(self)
        self._finish(code, details)

    async def _serve(self, handler) -> None:
        """Read the request (or hand the handler its iterator), run the handler, send what it returns."""
        deserialize = handler.request_deserializer
        if handler.request_streaming:
            request = self._request_iterator(deserialize)
        else:
            payload = await self._next_request()
            if payload is None:
                raise _Status(grpc.StatusCode.INTERNAL, "the call ended without its request message")
            request = self._parse(deserialize, payload)
        self._serialize = handler.response_serializer
        if handler.response_streaming:
            fn = handler.stream_stream if handler.request_streaming else handler.unary_stream
            result = fn(request, self)
            if inspect.isasyncgen(result):
                try:
                    async for item in result:
                        await self.write(item)
                finally:
                    await result.aclose()  # cancelled while sending: the handler's own `finally` runs now
            elif inspect.isawaitable(result):
                await result  # it wrote its messages with `context.write`
            elif result is not None:
                for item in result:
                    await self.write(item)
        else:
            fn = handler.stream_unary if handler.request_streaming else handler.unary_unary
            result = fn(request, self)
            if inspect.isawaitable(result):
                result = await result
            if result is not None and self._code in (None, _OK):
                await self.write(result)

    @staticmethod
    def _parse(deserialize, payload: bytes):
        if deserialize is None:
            return payload
        try:
            return deserialize(payload)
        except Exception as e:  # noqa: BLE001 - what grpc answers for a request its parser refused
            raise _Status(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {e}") from None

    async def _next_request(self) -> Optional[bytes]:
        while not self._requests:
            if self._request_ended:
                return None
            self._reader = asyncio.get_running_loop().create_future()
            await self._reader
        payload = self._requests.popleft()
        if self._unacknowledged and len(self._requests) < _QUEUED_REQUESTS:
            self.conn.acknowledge(self.stream_id, self._unacknowledged)
            self._unacknowledged = 0
        return payload

    async def _request_iterator(self, deserialize):
        while (payload := await self._next_request()) is not None:
            yield self._parse(deserialize, payload)

    def _wake_reader(self) -> None:
        reader, self._reader = self._reader, None
        wake(reader)

    def _send_headers(self, metadata=()) -> None:
        self.headers_sent = True
        block = _HEAD + http2.header_block(wire.header_pairs(metadata)) if metadata else _HEAD
        self.conn.send_headers(self, block, end_stream=False)

    async def _drain(self) -> None:
        if self.closed:
            return
        self._drained = asyncio.get_running_loop().create_future()
        await self._drained

    def _finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the status (after whatever still waits for the client's windows)."""
        if self.closed:
            return
        self.closed = True
        self._cancel_timer()
        trailers = _STATUS[code]
        if details:
            trailers += http2.literal(b"grpc-message", wire.encode_details(details).encode("ascii"))
        if self._trailing:
            trailers += http2.header_block(wire.header_pairs(self._trailing))
        if not self.headers_sent:  # trailers-only: one HEADERS frame
            self.headers_sent = True
            trailers = _TRAILERS_ONLY_HEAD + trailers
        self.trailers = trailers
        self.conn.end_call(self)

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        """The server ends the call (the handler, if it runs, is cancelled and sends nothing)."""
        self._buffer.clear()
        task = self.task
        self._finish(code, details)
        if task is not None and not task.done():
            self.peer_gone = True  # its own status is out: the cancelled handler sends none
            task.cancel()

    def _expire(self) -> None:
        self._deadline_timer = None
        self._expired = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _cancel_timer(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    # ---- a fast lane's direct path ---------------------------------------------------------------
    def can_send_now(self) -> bool:
        """A message handed over now would go out without waiting (nothing before it waits)."""
        return self.headers_sent and not self.closed and not self.pending and not self.conn.paused

    def send_now(self, payload: bytes) -> None:
        """A serialized response message, sent as it is (after `can_send_now`)."""
        self.conn.send_data(self, wire.message(payload))

    # ---- grpc.aio.ServicerContext ------------------------------------------------------------------
    async def write(self, message) -> None:
        if self.closed:
            raise asyncio.CancelledError() if self.peer_gone else grpc.aio.UsageError("the call is over")
        if not self.headers_sent:
            self._send_headers()
        payload = self._serialize(message) if self._serialize is not None else message
        self.conn.send_data(self, wire.message(payload))
        if self.pending or self.conn.paused:
            self._burst = 0
            await self._drain()
        else:
            self._burst += 1
            if self._burst == _BURST:  # a handler that never waits still lets the loop (and the writes) run
                self._burst = 0
                await asyncio.sleep(0)

    async def read(self):
        payload = await self._next_request()
        return grpc.aio.EOF if payload is None else payload

    async def send_initial_metadata(self, initial_metadata) -> None:
        if self.headers_sent:
            raise grpc.aio.UsageError("the initial metadata was sent already")
        self._send_headers(initial_metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        if code == _OK:
            raise ValueError("abort needs a status other than OK")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> Optional[grpc.StatusCode]:
        return self._code

    def details(self) -> Optional[str]:
        return self._details

    def set_trailing_metadata(self, trailing_metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self):
        return self._trailing

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self) -> Optional[float]:
        timer = self._deadline_timer
        return None if timer is None else max(0.0, timer.when() - asyncio.get_running_loop().time())

    def peer(self) -> str:
        return self._peer

    def cancelled(self) -> bool:
        return self.peer_gone or self._expired

    def done(self) -> bool:
        return self.closed

    def add_done_callback(self, callback) -> None:
        self._done_callbacks.append(callback)

    def set_compression(self, compression) -> None:
        pass  # responses go uncompressed

    def disable_next_message_compression(self) -> None:
        pass

    def auth_context(self) -> dict:
        return {}
