"""Per-request output queues of a worker that streams (CE, NORMAL).

The queue opens when the request is admitted, before anyone reads it: a CE's first output
(the hand-off) may come before the router opens its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deepinfer_core.outputs import RequestOutput
from services.common.deltas import OutputDiffer, SampleDelta
from services.common.errors import ErrorCode, ServiceError

_ABORTED = object()


class OutputStreams:
    def __init__(self):
        self._queues: dict[str, asyncio.Queue] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def open(self, request_id: str) -> None:
        self._queues[request_id] = asyncio.Queue()

    def push(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    def close(self, request_id: str) -> bool:
        """The request was aborted: a reader sees finish_reason 'abort'."""
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(_ABORTED)
        return q is not None

    async def deltas(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """The request's deltas until it finishes. Raises NOT_FOUND for an unknown request."""
        q = self._queues.get(request_id)
        if q is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no request {request_id!r} on this worker")
        differ = OutputDiffer()
        while True:
            out = await q.get()
            if out is _ABORTED:
                yield SampleDelta(token_offset=differ.num_tokens, text_offset=len(differ.text), finish_reason="abort")
                return
            delta = differ.diff(out.outputs[0], out.num_cached_tokens)
            if delta is not None:
                yield delta
            if out.finished:
                self._queues.pop(request_id, None)
                return
