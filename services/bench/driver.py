"""Running a load: a test request, warm-ups, then every request at its arrival time."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
from tqdm import tqdm

from services.bench.arrivals import arrival_offsets
from services.bench.client import send
from services.bench.payload import Sampling, endpoint_kind, request_body
from services.bench.records import BenchRequest, RequestRecord


@dataclass(frozen=True)
class Target:
    """The server under test."""

    base_url: str
    """Scheme, host and port (a trailing /v1 is fine too)."""
    model: str
    endpoint: str = "/v1/completions"
    api_key: Optional[str] = None
    sampling: Sampling = field(default_factory=Sampling)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base[: -len("/v1")]
        return base + self.endpoint

    @property
    def kind(self) -> str:
        return endpoint_kind(self.endpoint)


@dataclass(frozen=True)
class Load:
    """How the requests are offered."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    """At most this many in flight; later arrivals wait for a slot."""
    num_warmups: int = 0
    seed: int = 0
    request_timeout_s: float = 600.0
    """Longest wait for the next byte of a response."""
    progress: bool = True


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    """One per request sent, in dataset order; requests never sent (an abort) have none."""
    duration: float
    """Seconds from the first send to the last response's end."""
    aborted: str = ""
    """Why the run stopped before sending every request ("" when it did not)."""


async def run_load(
    target: Target, requests: list[BenchRequest], load: Load, stop: Optional[asyncio.Event] = None
) -> RunOutcome:
    """Check the server with one request, warm it up, then run `requests` under `load`.

    Setting `stop` ends the run early: requests in flight are abandoned, the finished ones kept.
    """
    stop = stop or asyncio.Event()
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
    bodies = [request_body(target.kind, target.model, r, target.sampling) for r in requests]
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    slots = load.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=slots + 1, max_keepalive_connections=slots + 1)
    timeout = httpx.Timeout(load.request_timeout_s, connect=10.0, pool=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        test = await send(http, target.url, target.kind, _short(bodies[0], target.kind), requests[0].prompt_len)
        if not test.success:
            return RunOutcome([], 0.0, aborted=f"the test request to {target.url} failed: {test.error}")
        if load.num_warmups:
            warm = [bodies[i % len(bodies)] for i in range(load.num_warmups)]
            lens = [0] * len(warm)
            await _gather(http, target, _Batch(warm, [0.0] * len(warm), lens), min(slots, len(warm)), stop, None)
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not load.progress)
        try:
            start = time.perf_counter()
            batch = _Batch(bodies, offsets, [r.prompt_len for r in requests])
            records = await _gather(http, target, batch, slots, stop, bar)
        finally:
            bar.close()
    duration = max((r.end for r in records), default=start) - start
    aborted = "interrupted before every request was sent" if len(records) < len(requests) else ""
    return RunOutcome(records, duration, aborted)


def _short(body: dict, kind: str) -> dict:
    """The test request: the first request's body, cut to a few output tokens."""
    key = "max_completion_tokens" if kind == "chat" else "max_tokens"
    return {**body, key: min(4, body[key])}


@dataclass
class _Batch:
    bodies: list[dict]
    offsets: list[float]
    """Seconds after the batch's start at which each body is sent."""
    prompt_lens: list[int]


async def _gather(http, target: Target, batch: _Batch, slots: int, stop: asyncio.Event, bar) -> list[RequestRecord]:
    """Send the batch; on `stop`, cancel what is pending and return the records finished so far."""
    semaphore = asyncio.Semaphore(slots)
    done: list[Optional[RequestRecord]] = [None] * len(batch.bodies)
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + batch.offsets[i] - time.perf_counter()))
        async with semaphore:
            done[i] = await send(http, target.url, target.kind, batch.bodies[i], batch.prompt_lens[i])
        if bar is not None:
            bar.update(1)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(batch.bodies))]
    everything = asyncio.gather(*tasks)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopper, everything], return_when=asyncio.FIRST_COMPLETED)
        if everything.done():
            everything.result()  # a bug in a task surfaces here rather than vanishing
    finally:
        for task in [*tasks, stopper]:
            task.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)
    return [r for r in done if r is not None]
