"""The fast lane's front-door half for a streamed completion over HTTP/1.1 (`services/common/fast_lane.py`).

For an ordinary mid-stream delta it does, in one call, what the chain above the router would:
`Choice.add` and the stream's clock (`GatewayCore.generate`), the SSE event's bytes
(`StreamChunks`, the same template as the chain's: `completion_events` / `chat_events`), and
the write of that event to the connection as uvicorn's own `send` frames it
(`b"%x\\r\\n" % len(body) + body + b"\\r\\n"`, one `transport.write`). `EventStream` hands it the
connection's uvicorn request-response cycle once the response has started; no cycle (a test
client, another server, a framing other than chunked), no fast lane: the chain does everything.

It is ready only while the connection can take a write without waiting: not while uvicorn's flow
control has paused writing (a client that does not read; the chain's `send` waits for the drain,
and every delta after is queued behind it), nor once the client has left or the transport closes.

Only requests with one prompt, one sample and no logprobs get a lane (`for_request`): those are
the bulk of streams, and everything else keeps its one path.

Where `services.native` is built, the lane also has a compiled half (`NativeLane`) for the same
events: the event's text around the token's (`StreamChunks.running_parts`), the same connection,
the same readiness checks; `absorb` brings the choice and the clock up to what it wrote.
"""

from __future__ import annotations

from typing import Optional

from services.common.fast_lane import COUNTS
from services.gateway.front_lane import FrontLane
from services.gateway.uvicorn_cycle import chunked_cycle
from services.native import NativeLane


class SseLane(FrontLane):
    __slots__ = ("render", "_cycle", "_transport", "_flow")

    def __init__(self):
        super().__init__()
        self.render = None
        """`StreamChunks.completion` or `.chat` (choice, delta) -> the event's bytes (None: no event);
        set by the event stream once the choice's first event is out."""
        self._cycle = None
        self._transport = None
        self._flow = None

    @classmethod
    def for_request(cls, prompts: list, params) -> Optional[SseLane]:
        if len(prompts) != 1 or params.n != 1 or params.logprobs is not None:
            return None
        return cls()

    def set_render(self, chunks, chat: bool) -> None:
        """The choice's first event is out: later ones are `chunks`' (`StreamChunks`), `chat` or not."""
        self.render = chunks.chat if chat else chunks.completion
        if NativeLane is not None and self._cycle is not None:
            head, tail = chunks.running_parts(self.choice.index, chat)
            self.native = NativeLane(self._transport, self._cycle, self._flow, head, tail, chat)

    def connect(self, send) -> None:
        """`send`: the HTTP server's own (`EventStream`); the response has started."""
        cycle = chunked_cycle(send)
        if cycle is None:
            return
        self._cycle, self._transport, self._flow = cycle, cycle.transport, cycle.flow

    def ready(self) -> bool:
        cycle = self._cycle
        if cycle is None or self.render is None or cycle.disconnected or cycle.response_complete:
            return False
        if self._flow.write_paused:
            COUNTS.paused += 1
            return False
        return not self._transport.is_closing()

    def deliver(self, delta) -> None:
        self.note(delta)
        body = self.render(self.choice, delta)
        if body:
            self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))
