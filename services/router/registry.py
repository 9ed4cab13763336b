"""The pool registry: workers join and leave at run time; the router's view of their load.

The router is the only dispatcher, so it counts exactly what it has sent to each worker
(`inflight`, `inflight_tokens`); the workers' own reports (polled `Stats`) add what only the
engine knows (free blocks, prefix hits) and tell whether a worker is alive. A worker that
misses `max_failures` polls in a row is removed.

A `RegistryMirror` feeds a registry from another router's membership instead of from workers
registering: each extra API process of `deepinfer serve --api-workers N` routes on its own, over
the workers that registered with the head.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo, WorkerLoad
from services.router.clients import WorkerClient
from services.router.prefix_index import PrefixSet, capacity_for

logger = logging.getLogger(__name__)

READY, DRAINING = "ready", "draining"


@dataclass
class WorkerHandle:
    info: WorkerInfo
    client: WorkerClient
    state: str = READY
    load: WorkerLoad = field(default_factory=WorkerLoad)
    """The worker's last report."""
    inflight: int = 0
    """Requests the router has on this worker now."""
    inflight_tokens: int = 0
    """PE: prompt tokens of prefills in flight. CE / NORMAL: prompt + max output tokens of its requests."""
    inflight_blocks: int = 0
    """CE / NORMAL: the KV blocks its requests may come to hold (each one's tokens in whole blocks)."""
    failures: int = 0
    connected_peers: bool = True
    """This registry connected its PEs to it (a CE), so it disconnects them when it leaves."""
    joined_at: float = field(default_factory=time.monotonic)
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the worker's process is known to be gone (`PoolRegistry.declare_dead`): nothing of
    it runs any more, so no KV write of it can still be posted."""
    prefixes: PrefixSet = field(init=False)
    """The prompt prefixes the router sent here (prefix-aware routing); a worker that rejoins starts empty."""

    def __post_init__(self) -> None:
        self.prefixes = PrefixSet(capacity_for(self.info.num_blocks, self.info.block_size))

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class PoolRegistry:
    def __init__(self, client_factory: Callable[[WorkerInfo], WorkerClient], max_failures: int = 3):
        self.client_factory = client_factory
        self.max_failures = max_failures
        self.workers: dict[str, WorkerHandle] = {}
        self._left: dict[str, WorkerHandle] = {}
        """Workers that left lately (oldest first): one may be declared dead after it left."""
        self._dead: dict[str, tuple[int, float]] = {}
        """Workers declared dead lately (oldest first) -> (their pid, when): what `recently_dead` lists."""
        self._changed = asyncio.Event()

    # ---- membership ------------------------------------------------------------------------
    async def add(
        self, info: WorkerInfo, client: Optional[WorkerClient] = None, connect_peers: bool = True
    ) -> WorkerHandle:
        """A worker joins its pool; PEs connect to every CE's transfer agent and prepare its
        descriptors now, not on a request's path (unless `connect_peers` is False: a mirror's
        workers were connected by the router they registered with)."""
        old = self.workers.pop(info.worker_id, None)
        if old is not None:
            await old.client.close()
        handle = WorkerHandle(info, client or self.client_factory(info), connected_peers=connect_peers)
        if connect_peers:
            await self._connect_peers(handle)
        self.workers[info.worker_id] = handle
        logger.info("worker %s joined the %s pool at %s", info.worker_id, info.pool_name, info.address)
        self._notify()
        return handle

    async def _connect_peers(self, handle: WorkerHandle) -> None:
        info = handle.info
        if info.pool == POOL_DECODE and info.agent_name:
            for pe in self.pool(POOL_PREFILL, ready_only=False):
                await self._connect(pe, info)
        if info.pool == POOL_PREFILL:
            for ce in self.pool(POOL_DECODE, ready_only=False):
                if ce.info.agent_name:
                    await self._connect(handle, ce.info)

    async def _connect(self, pe: WorkerHandle, ce: WorkerInfo) -> None:
        """Connect the PE to the CE and prepare the CE's transfer descriptors on it (given its region)."""
        try:
            await pe.client.connect_peer(ce.agent_name, ce.agent_metadata, ce.kv_region)
        except ServiceError as e:  # the first hand-off connects lazily (a mismatched layout is refused there too)
            logger.warning("could not connect %s to %s: %s", pe.worker_id, ce.worker_id, e)

    async def remove(self, worker_id: str, disconnect: bool = True) -> bool:
        """The worker leaves its pool; `disconnect`: a CE's PEs let go of its transfer agent."""
        handle = self.workers.pop(worker_id, None)
        if handle is None:
            return False
        logger.info("worker %s left the %s pool", worker_id, handle.info.pool_name)
        self._left.pop(worker_id, None)
        self._left[worker_id] = handle
        while len(self._left) > _LEFT_KEPT:
            del self._left[next(iter(self._left))]
        self._notify()  # routing stops at once; the clean-up below may take a moment
        await handle.client.close()
        if disconnect and handle.connected_peers and handle.info.pool == POOL_DECODE and handle.info.agent_name:
            await self._disconnect(handle.info.agent_name)
        return True

    async def _disconnect(self, agent_name: str) -> None:
        """The PEs let go of a CE that left: a restarted CE is a new peer, nothing stale piles up."""
        pes = self.pool(POOL_PREFILL, ready_only=False)
        results = await asyncio.gather(*(_let_go(pe, agent_name) for pe in pes), return_exceptions=True)
        for pe, result in zip(pes, results):
            if isinstance(result, Exception):
                logger.warning("%s could not let go of %s: %s", pe.worker_id, agent_name, result)

    def declare_dead(self, worker_id: str, pid: int = 0) -> None:
        """The worker's process is gone (its actor died, or stopped with its engine): whoever waits
        on `wait_dead` for it (a reservation fenced against its writes) may go on. `pid`: only if
        that is the process this registry knows by the id (a notice relayed late must not end a
        worker registered again under the same id)."""
        handle = self.workers.get(worker_id) or self._left.get(worker_id)
        if handle is None or (pid and handle.info.pid and handle.info.pid != pid):
            return
        handle.dead.set()
        if worker_id not in self._dead:
            self._dead[worker_id] = (handle.info.pid, time.monotonic())
            while len(self._dead) > _LEFT_KEPT:
                del self._dead[next(iter(self._dead))]

    def recently_dead(self) -> list[tuple[str, int]]:
        """(worker id, pid) of the workers declared dead within `DEAD_LISTED_S`: the notices a
        mirror of this registry relays to its own waiters (`RegistryMirror.apply`)."""
        since = time.monotonic() - DEAD_LISTED_S
        for worker_id in [w for w, (_, at) in self._dead.items() if at < since]:
            del self._dead[worker_id]
        return [(worker_id, pid) for worker_id, (pid, _) in self._dead.items()]

    @staticmethod
    async def wait_dead(handle: WorkerHandle, timeout_s: float) -> bool:
        """Whether the worker is declared dead within `timeout_s`."""
        try:
            await asyncio.wait_for(handle.dead.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def drain(self, worker_id: str) -> Optional[WorkerHandle]:
        """Route no new work to the worker."""
        handle = self.workers.get(worker_id)
        if handle is not None:
            handle.state = DRAINING
            self._notify()
        return handle

    def pool(self, pool: int, ready_only: bool = True) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.info.pool == pool and (h.state == READY or not ready_only)]

    # ---- waiting for change ----------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until a worker joins, leaves or finishes work, or `timeout_s` passes."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def released(self, handle: WorkerHandle) -> None:
        """Work left a worker: waiters for capacity may try again."""
        self._notify()

    # ---- health and load ---------------------------------------------------------------------
    async def poll_once(self, timeout_s: float = 2.0) -> None:
        handles = list(self.workers.values())
        results = await asyncio.gather(*(h.client.stats(timeout_s) for h in handles), return_exceptions=True)
        for handle, result in zip(handles, results):
            if isinstance(result, WorkerLoad):
                handle.load, handle.failures = result, 0
                continue
            handle.failures += 1
            logger.warning("worker %s missed a health poll (%d): %s", handle.worker_id, handle.failures, result)
            if handle.failures >= self.max_failures and self.workers.get(handle.worker_id) is handle:
                await self.remove(handle.worker_id)

    async def probe(self, handle: WorkerHandle, timeout_s: float = 2.0) -> None:
        """Poll one worker now (a call to it failed as if it were gone); one that cannot be reached
        leaves at once. Slow is not gone: a worker that only times out is left to the polls."""
        if self.workers.get(handle.worker_id) is not handle:
            return
        try:
            handle.load, handle.failures = await handle.client.stats(timeout_s), 0
        except ServiceError as e:
            if e.code == ErrorCode.UNAVAILABLE and self.workers.get(handle.worker_id) is handle:
                logger.warning("worker %s is unreachable: removing it (%s)", handle.worker_id, e)
                await self.remove(handle.worker_id)

    async def run_polling(self, interval_s: float) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for worker_id in list(self.workers):
            await self.remove(worker_id, disconnect=False)  # every worker goes: nothing to tell the PEs


_LEFT_KEPT = 256
"""Workers that left remembered for `declare_dead`: far more than leave within a death's detection."""
DEAD_LISTED_S = 60.0
"""How long a death stays listed for mirrors: longer than any waiter waits for it
(`RouterConfig.writer_death_wait_s`) and than a mirror's polls may be late."""


async def _let_go(pe: WorkerHandle, agent_name: str) -> None:
    await pe.client.disconnect_peer(agent_name)


class RegistryMirror:
    """Keeps a registry's membership the copy of another router's: workers are added and removed as
    that router lists them (`Router.Status`), drained when it drains them. Load and health stay this
    registry's own (it polls each worker itself), and a worker it dropped for missed polls is not
    taken back while the other router still lists it unchanged (that router will drop it too)."""

    def __init__(self, registry: PoolRegistry):
        self.registry = registry
        self._mirrored: dict[str, WorkerInfo] = {}
        """What the other router listed at the last `apply`, by worker id."""

    async def apply(self, listed: list[tuple[WorkerInfo, str]], dead: list[tuple[str, int]] = ()) -> None:
        """Bring the registry to `listed`: (info, state) of every worker of the other router; `dead`:
        (worker id, pid) of those it declared dead lately, declared dead here too (a reservation this
        router fenced against such a worker's writes is freed now, not at the end of its lease)."""
        upstream = {info.worker_id: (info, state) for info, state in listed}
        for worker_id in [w for w in self._mirrored if w not in upstream]:
            del self._mirrored[worker_id]
            await self.registry.remove(worker_id)
        for worker_id, (info, state) in upstream.items():
            if self._mirrored.get(worker_id) != info:  # new, or registered again (a new address or pid)
                self._mirrored[worker_id] = info
                await self.registry.add(info, connect_peers=False)
            handle = self.registry.workers.get(worker_id)
            if handle is not None and state == DRAINING and handle.state != DRAINING:
                self.registry.drain(worker_id)
        for worker_id, pid in dead:  # after the removals: the handle is among those that left
            self.registry.declare_dead(worker_id, pid)
