"""Faults injected into a real in-process P/D cluster (PE and CE worker cores, real engines, real
NIXL over UCX loopback, the real router over `LocalWorkerClient`s): streams that break after N
deltas (a CE dying mid-stream, as the router sees it), every Nth NIXL write failing at post time,
delays on any call; and the check that every stage is back at its baseline afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

from deepinfer_core.errors import TransferError
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_DECODE, POOL_PREFILL
from services.router.clients import LocalWorkerClient
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry
from services.workers.decode_core import DecodeCore
from services.workers.prefill_core import PrefillCore
from services.workers.worker_server import worker_info


@dataclass
class Faults:
    """What to break. Every field is read at call time: a test may change it mid-run."""

    break_after: dict[str, int] = field(default_factory=dict)
    """worker id -> the stream of each request on it fails (UNAVAILABLE) after this many deltas."""
    delay_s: dict[str, float] = field(default_factory=dict)
    """"reserve" / "prefill" / "stream" -> a pause before each such call."""
    broken: int = 0
    """Streams broken so far."""


class FaultyClient(LocalWorkerClient):
    def __init__(self, core, faults: Faults):
        super().__init__(core)
        self.faults = faults

    async def _pause(self, what: str) -> None:
        delay = self.faults.delay_s.get(what, 0.0)
        if delay:
            await asyncio.sleep(delay)

    async def reserve(self, request_id, prompt, params, lease_s, timeout):
        await self._pause("reserve")
        return await super().reserve(request_id, prompt, params, lease_s, timeout)

    async def prefill(self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0):
        await self._pause("prefill")
        return await super().prefill(request_id, prompt, params, kv_target, timeout, images, resumed_tokens)

    async def stream(self, request_id, timeout):
        await self._pause("stream")
        limit = self.faults.break_after.get(self.core.worker_id)
        inner = self.core.stream(request_id)
        try:
            async for n, delta in aiter_enumerate(inner):
                if limit is not None and n >= limit:
                    self.faults.broken += 1
                    raise ServiceError(ErrorCode.UNAVAILABLE, f"worker {self.core.worker_id} is unreachable (injected)")
                yield delta
        finally:
            await inner.aclose()


async def aiter_enumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def fail_every_nth_post(agent, n: int) -> list[int]:
    """Make every `n`th NIXL write `agent` posts fail as a dead peer's would; returns the list the
    failed posts' numbers are appended to."""
    failed: list[int] = []
    count = itertools.count(1)
    real = agent.post

    def post(prepared):
        k = next(count)
        if k % n == 0:
            agent.discard(prepared)
            failed.append(k)
            raise TransferError(f"injected failure of write {k}")
        return real(prepared)

    agent.post = post
    return failed


@contextlib.asynccontextmanager
async def pd_cluster(pe_engine, ce_engines: dict[str, object], specs: dict, faults: Faults, **config):
    """The router over one PE ("pe-0") and the CEs `ce_engines` (worker id -> engine), every call
    through a `FaultyClient`; yields (router, cores by worker id)."""
    cores = {"pe-0": PrefillCore(pe_engine, "pe-0")}
    cores.update({wid: DecodeCore(engine, wid) for wid, engine in ce_engines.items()})
    registry = PoolRegistry(lambda info: FaultyClient(cores[info.worker_id], faults))
    for core in cores.values():
        core.start()
    try:
        for wid, core in cores.items():
            await registry.add(worker_info(specs[wid], core.engine, "local"))
        router = RouterCore(registry, RouterConfig(pools=(POOL_PREFILL, POOL_DECODE), **config))
        try:
            yield router, cores
        finally:
            await router.stop()
    finally:
        for core in cores.values():
            core.stop()


def held(router: RouterCore, cores: dict) -> dict[str, tuple]:
    """worker id -> (router in flight, in-flight tokens, engine requests, reservations, quarantined
    leases, KV blocks in use, open streams)."""
    out = {}
    for wid, core in cores.items():
        load, engine = core.stats(), core.engine
        handle = router.registry.workers.get(wid)
        out[wid] = (
            handle.inflight if handle else 0,
            handle.inflight_tokens if handle else 0,
            load.requests,
            load.reservations,
            len(getattr(engine, "quarantine", {})),
            load.num_blocks - load.free_blocks,
            core.open_streams(),
        )
    return out


async def at_rest(router: RouterCore, cores: dict, timeout_s: float = 10.0) -> dict[str, tuple]:
    """Until every stage holds nothing (background aborts land after the request ended)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        view = held(router, cores)
        if all(not any(v) for v in view.values()) or loop.time() > deadline:
            return view
        await asyncio.sleep(0.05)
