"""The HTTP response of a streamed completion: its SSE events written straight to the server.

Starlette's `StreamingResponse` passes every chunk down through each middleware's `send` wrapper
(each one only watches for the response to start) and runs the body in an anyio task group beside
a disconnect listener; per streamed token that cost more than building the chunk. `EventStream`
sends the response start through the `send` it is given, so every middleware sees the response
begin, then each event through the server's own `send`, which `EventStreamApp` leaves in the scope
(`SERVER_SEND`). The bytes, the headers and the chunked framing are the server's, as before.

The events are pumped in a task of their own, beside the request's `ClientWatch` (which reads
`receive`): the client leaving cancels the pump, whose generators end there (their `finally`s abort
the request upstream). The admitted work is let go once the response is over, whether the stream ran
to its end, failed, or never started.

A request's fast lane (`sse_lane.py`) is given the server's `send` once the response has started:
from then on its ordinary mid-stream events are written to the connection without the pump.

The response head waits for the first event and, on uvicorn's httptools server, leaves in the same
write (`uvicorn_cycle.start_with_chunk`); the stream's `Last` item ends the body in its own write.
A stream is two writes besides what the lane writes, where it was four.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.responses import StreamingResponse

from services.gateway.chunks import Last
from services.gateway.client_watch import ClientWatch
from services.gateway.uvicorn_cycle import start_with_chunk

SERVER_SEND = "deepinfer.server_send"
"""Scope key: the HTTP server's own `send`, outside every middleware."""


class EventStreamApp(FastAPI):
    """The FastAPI app, leaving the server's `send` in each HTTP request's scope for `EventStream`.

    `direct` routes (method, path) -> ASGI app are served without FastAPI's and Starlette's layers
    (their error and exception middleware, body limit, exit stack, routing, `request_response`):
    on short requests those layers cost about a quarter of the head's CPU. A direct route does what
    they did for it itself (its errors as responses, the body's limit); the same path with another
    method, and every other path, go through FastAPI as before."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.direct: dict[tuple[str, str], object] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
            direct = self.direct.get((scope["method"], scope["path"]))
            if direct is not None:
                scope["app"] = self
                return await direct(scope, receive, send)
        await super().__call__(scope, receive, send)


class EventStream(StreamingResponse):
    """`text/event-stream` of `events`; `on_end()` once the response is over."""

    def __init__(self, events: AsyncIterator[bytes], on_end, lane=None, watch=None):
        """`lane`: the request's fast lane (`sse_lane.py`), connected to the server's `send` here.
        `watch`: the request's `ClientWatch`, already watching for the client to leave (None: one
        is started here), stopped when the response is over."""
        super().__init__(events, media_type="text/event-stream")
        self._on_end = on_end
        self._lane = lane
        self._watch = watch

    async def __call__(self, scope, receive, send) -> None:
        watch = self._watch if self._watch is not None else ClientWatch(receive)
        try:
            await self._stream(scope, send, watch)
        finally:
            watch.stop()
            self._on_end()

    async def _stream(self, scope, send, watch: ClientWatch) -> None:
        # in tasks of their own: each wake-up resumes the stream's frames, not every ASGI layer's above it
        pump = asyncio.ensure_future(self._pump(send, scope.get(SERVER_SEND, send)))  # no SERVER_SEND: a test client
        try:
            await asyncio.wait((pump, watch.task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.stop()
            pump.cancel()  # the client left first (or this request is cancelled); nothing once it is done
            await asyncio.wait((pump,))
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()

    async def _pump(self, send, server_send) -> None:
        events = self.body_iterator
        try:
            first = await anext(events, None)
            with_head = await self._start(send, server_send, first)
            if self._lane is not None:
                self._lane.connect(server_send)
            if first is None:  # no events at all
                await server_send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if not with_head and not await _send_event(server_send, first):
                return
            async for event in events:
                if not await _send_event(server_send, event):
                    return
            await server_send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()  # its clean-up now (an abort upstream), not whenever it is collected

    async def _start(self, send, server_send, first) -> bool:
        """Start the response; whether `first` (the first event) went out in the same write."""
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        # a `send` of the app's layers must see the start go by; a `Last` goes with the body's end
        if first is not None and type(first) is not Last and send is server_send:
            if await start_with_chunk(send, start, first):
                return True
        await send(start)
        return False


async def _send_event(send, event: bytes) -> bool:
    """Send `event`; False when it was the stream's `Last`, which ends the body in the same write."""
    more = type(event) is not Last
    await send({"type": "http.response.body", "body": event, "more_body": more})
    return more
