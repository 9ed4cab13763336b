"""A worker core whose engine streams tokens to clients (colocated NORMAL, decode CE)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.common.deltas import SampleDelta
from services.workers.base_core import WorkerCore
from services.workers.streams import OutputStreams


class StreamingCore(WorkerCore):
    def __init__(self, engine, worker_id: str = "", loop=None):
        super().__init__(engine, worker_id, loop)
        self.streams = OutputStreams()

    async def relay(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """The request's deltas until it finishes; a reader that goes away aborts the request."""
        finished = False
        self.num_open_streams += 1
        try:
            async for delta in self.streams.deltas(request_id):
                finished = delta.finished
                yield delta
        finally:
            self.num_open_streams -= 1
            if not finished and request_id in self.streams:
                await self.abort(request_id)

    def _forget(self, request_id: str) -> bool:
        return self.streams.close(request_id)

    def _on_turn(self, outputs: list, handoff_results: list) -> None:
        for out in outputs:
            self.streams.push(out)
