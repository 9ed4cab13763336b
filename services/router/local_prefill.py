"""Conditional disaggregation, the router's side: offer a sample to a CE to prefill itself.

A CE with room is picked as for a reservation; if the part of the prompt it is not believed to
hold (`prefix_index.py`) is at most `PDConfig.local_prefill_tokens`, the sample is submitted to it
as a whole request. The CE decides against its own prefix cache and step bound: when it declines
(RESOURCE_EXHAUSTED) or cannot be reached before any token came, the sample takes the P/D path as
if nothing had happened. Once its first token is out, the stream is the CE's like any decode
stream: a break migrates the sample (`request_flow.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_DECODE
from services.metrics import definitions as m

_DECLINED = (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE)
"""Before any token: the CE would not (or could not) take it; a PE will."""


async def local_prefill(flow, prompt: list[int], params: SamplingParams) -> Optional[AsyncIterator[SampleDelta]]:
    """The sample's deltas from a CE that prefills it itself; None: take the P/D path."""
    ce = flow.router.pick_decode(POOL_DECODE, flow.kv_tokens, set(flow.suspects))
    limit = flow.config.pd.local_prefill_tokens
    if ce is None or len(prompt) - ce.prefixes.matched_tokens(flow.prefix) > limit:
        return None
    sub_id = flow._sub_id() + "/local"
    flow._hold(ce, flow.kv_tokens, None)
    m.QUEUE_TIME.labels(flow.router.model).observe(time.monotonic() - flow.arrival)
    stream = ce.client.generate(sub_id, prompt, params, flow.remaining(), resumed_tokens=flow.resumed_tokens(prompt))
    try:
        first = await stream.__anext__()
    except ServiceError as e:
        flow._release(ce, flow.kv_tokens)
        await stream.aclose()
        if e.code not in _DECLINED:
            raise
        if e.code == ErrorCode.UNAVAILABLE:
            flow.router.suspect(ce)
        return None
    except BaseException:
        flow._release(ce, flow.kv_tokens)
        await stream.aclose()
        flow.router.abort_later(ce, sub_id, prefill=False)
        raise
    m.ROUTER_DECISIONS.labels("local_prefill", ce.worker_id).inc()
    ce.prefixes.record(flow.prefix)
    return _relay(flow, ce, sub_id, first, stream)


async def _relay(flow, ce, sub_id: str, first: SampleDelta, rest: AsyncIterator[SampleDelta]):
    async def whole():
        yield first
        async for delta in rest:
            yield delta

    relay = flow._until_broken(ce, sub_id, whole())
    try:
        async for delta in relay:
            yield delta
    finally:
        await relay.aclose()
        await rest.aclose()
        flow._release(ce, flow.kv_tokens)
