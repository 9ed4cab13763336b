"""Several delta streams read as one: the router merges a request's samples, the gateway a
request's prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.common.deltas import SampleDelta


async def merge(streams: list[AsyncIterator[SampleDelta]]) -> AsyncIterator[tuple[int, SampleDelta]]:
    """(stream index, delta) from every stream as they come. The first stream error ends all
    of them; closing the merge cancels the streams (each aborts its own work)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[SampleDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta, None))
            queue.put_nowait((index, None, None))
        except Exception as e:
            queue.put_nowait((index, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                open_streams -= 1
                continue
            yield index, delta
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
