"""n > 1: one request becomes n single-sample sub-requests (seeds seed + i), merged back.

Prefill and decode engines take n = 1 (a CE reserves for one sequence), so the fan-out
happens before prefill; with a seed, sample i draws from seed + i, as the engine does for
an n > 1 request of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta


def split_samples(params: SamplingParams) -> list[SamplingParams]:
    samples = []
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if params.seed is not None:
            p.seed = params.seed + i
        if i > 0:
            p.prompt_logprobs = None  # reported once, with sample 0
        samples.append(p)
    return samples


async def merge(streams: list[AsyncIterator[SampleDelta]]) -> AsyncIterator[tuple[int, SampleDelta]]:
    """(sample index, delta) from every stream as they come. The first stream error ends all
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
