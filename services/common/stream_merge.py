"""Several delta streams read as one: the router merges a request's samples, the gateway a
request's prompts. A single stream needs none of this: its readers iterate it directly.

Each stream is pumped by its own task into one queue. The reader wakes once per batch of what
arrived meanwhile and takes all of it, folding each sample's waiting deltas into one
(`deltas.merge`): a reader that fell behind pays one delta per stream downstream, not one per token.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Optional

from services.common.deltas import SampleDelta
from services.common.deltas import merge as merge_deltas

FAILED = frozenset({"error", "abort", "preempted"})
"""Finish reasons that end a request with an error: such a delta is never folded into the one
before it, so the text that came first still reaches the client before the error does."""

_END = object()
"""Queued by a stream that ended without error."""


class _Merger:
    def __init__(self, streams: list[AsyncIterator[SampleDelta]]):
        self.queue: deque[tuple[int, object]] = deque()
        """(stream index, a delta, `_END` or the exception the stream raised), in arrival order."""
        self.waiter: Optional[asyncio.Future] = None
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    def _put(self, index: int, item: object) -> None:
        self.queue.append((index, item))
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _pump(self, index: int, stream: AsyncIterator[SampleDelta]) -> None:
        try:
            async for delta in stream:
                self._put(index, delta)
            self._put(index, _END)
        except Exception as e:
            self._put(index, e)

    async def wait(self) -> None:
        while not self.queue:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        self.waiter = None

    def take(self) -> tuple[dict[tuple[int, int], SampleDelta], int, Optional[BaseException]]:
        """Everything queued: each sample's deltas folded into one, keyed (stream index, sample index)
        in the order they first appear (a gateway's stream is one prompt's, with its n samples), how
        many streams ended, and the first error (what came before it is kept)."""
        folded: dict[tuple[int, int], SampleDelta] = {}
        ended = 0
        queue = self.queue
        while queue:
            index, item = queue.popleft()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                return folded, ended, item
            else:
                key = (index, item.index)
                before = folded.get(key)
                if before is None or item.finish_reason in FAILED:
                    if before is not None:  # the error gets its own turn, after the text before it
                        queue.appendleft((index, item))
                        return folded, ended, None
                    folded[key] = item
                else:
                    folded[key] = merge_deltas(before, item)
        return folded, ended, None

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def merge(streams: list[AsyncIterator[SampleDelta]]) -> AsyncIterator[tuple[int, SampleDelta]]:
    """(stream index, delta) from every stream as they come, each stream's waiting deltas as one.
    The first stream error ends all of them; closing the merge cancels the streams (each aborts
    its own work)."""
    merger = _Merger(streams)
    try:
        open_streams = len(streams)
        while open_streams:
            await merger.wait()
            folded, ended, error = merger.take()
            for (index, _), delta in folded.items():
                yield index, delta
            if error is not None:
                raise error
            open_streams -= ended
    finally:
        await merger.close()
