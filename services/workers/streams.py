"""Per-request output queues of a worker that streams (CE, NORMAL).

The queue opens when the request is admitted, before anyone reads it: a CE's first output
(the hand-off) may come before the router opens its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_core.outputs import RequestOutput
from services.common.deltas import OutputDiffer, SampleDelta
from services.common.errors import ErrorCode, ServiceError

_ABORTED = object()


@dataclass
class _Stream:
    after_handoff: bool
    """The first output is a hand-off's: its token went to the client with the PE's reply."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class OutputStreams:
    def __init__(self):
        self._streams: dict[str, _Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, after_handoff: bool = False) -> None:
        """`after_handoff`: the request's first output is a CE's hand-off, whose first token the
        client already has; the stream starts after it."""
        self._streams[request_id] = _Stream(after_handoff)

    def push(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.queue.put_nowait(out)

    def close(self, request_id: str) -> bool:
        """The request was aborted: a reader sees finish_reason 'abort'."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(_ABORTED)
        return stream is not None

    async def deltas(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """The request's deltas until it finishes. Raises NOT_FOUND for an unknown request."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no request {request_id!r} on this worker")
        differ = None if stream.after_handoff else OutputDiffer()
        while True:
            out = await stream.queue.get()
            if out is _ABORTED:
                differ = differ or OutputDiffer()
                yield SampleDelta(token_offset=differ.num_tokens, text_offset=len(differ.text), finish_reason="abort")
                return
            if differ is None:  # the hand-off: only its end, if the first token ended the request
                differ = OutputDiffer.after(out.outputs[0])
            delta = differ.diff(out.outputs[0], out.num_cached_tokens)
            if delta is not None:
                yield delta
            if out.finished:
                self._streams.pop(request_id, None)
                return
