"""ClusterController: the worker pools as Ray actors — start them, scale them, drain them.

Each pool has a target (its start size, `deepinfer scale`, or the planner's policy) and the
controller brings the pool's engine actors to it. Scaling up starts actors that register with the
router themselves; each asks Ray for its pool's placement (`placement.py`: the worker group's
custom resource, its GPUs), and one that waits for a node past a grace period is reported — in the
router's readiness detail (`/health`, `deepinfer status`) and a metric — while it keeps waiting for
Ray's autoscaler, up to the start deadline. Scaling down drains: the router stops sending work to
the worker, the worker refuses new work, and the actor is stopped only once the router has nothing
in flight there and the engine holds no request — no request is lost. Pools change independently
(one lock each), so a decode pool waiting for a node does not hold up the prefill pool.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from deepinfer_core.multimodal.encoder_config import EncoderConfig
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_NAMES
from services.controller.healing import PoolHealer
from services.controller.instances import Instance, start_instance
from services.controller.placement import PoolPlacement, unplaceable_reason
from services.router.core import RouterCore
from services.workers.spec import EngineSettings, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass
class PoolSpec:
    """How to build the workers of the cluster."""

    engine_args: EngineSettings = EngineSettings()
    model_name: str = ""
    host: str = "127.0.0.1"
    """Where workers serve; "" = their node's IP (a cluster of several machines)."""
    torch_threads: int = 1
    gpus_per_worker: float = 0.0
    log_level: str = "WARNING"
    encoder: EncoderConfig = EncoderConfig()
    """Vision encoders' batching, pool and cache."""
    stream_interval: int = 1
    """Tokens between a request's deltas on decode workers (`WorkerSpec.stream_interval`)."""
    grpc_server: str = "h2"
    """The workers' gRPC server (`WorkerSpec.grpc_server`)."""
    placements: dict[int, PoolPlacement] = field(default_factory=dict)
    """Per pool: the custom Ray resource and GPUs of one engine (a pool not listed: `gpus_per_worker`)."""
    placement_grace_s: float = 10.0
    """An engine not placed on a node after this long is reported as waiting for one."""
    start_timeout_s: float = 900.0
    """An engine not serving after this long (placement included: a new pod can take minutes) fails."""
    cluster_token: str = field(default="", repr=False)
    """The cluster credential each worker's server asks for and its registration carries."""
    reflection: bool = False
    """Workers serve gRPC reflection."""
    ep_sizes: dict[int, int] = field(default_factory=dict)
    """Per pool: ranks of each engine instance (expert parallelism, `instances.py`); absent: 1."""
    join_timeout_s: float = 120.0
    """A rank of an instance that has not joined its peers after this long fails the instance."""


@dataclass
class _Actor:
    pool: int
    handle: Any
    """The Ray actor."""
    registered: bool = False
    """Started and registered with the router."""
    draining: bool = False
    instance: Optional[Instance] = None
    """An expert-parallel instance: its ranks (each a worker of its own) and placement group."""

    def worker_ids(self, worker_id: str) -> list[str]:
        """The router's workers of this entry: the instance's ranks, or the engine itself."""
        return [w for w, _ in self.instance.ranks] if self.instance else [worker_id]

    def handles(self) -> list:
        return [h for _, h in self.instance.ranks] if self.instance else [self.handle]


class ClusterController:
    def __init__(self, spec: PoolSpec, router: RouterCore, router_address: str):
        self.spec = spec
        self.router = router
        self.router_address = router_address
        self.targets: dict[int, int] = {}
        self.actors: dict[str, _Actor] = {}
        self.waiting: dict[str, tuple[int, str]] = {}
        """worker id -> (pool, why it still waits for a node)."""
        self.listeners: list[Callable[[int, int], None]] = []
        """Called with (pool, target) whenever a target is set (the planner restarts its cool-downs)."""
        self._ids = itertools.count()
        self._locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.healer = PoolHealer(self)
        """Replaces engines whose actors die (`healing.py`)."""

    async def scale(self, targets: dict[int, Optional[int]], timeout_s: float = 600.0) -> None:
        """Set replica counts (None = unchanged); returns when new workers are ready and removed
        ones have drained and stopped."""
        wanted = {pool: target for pool, target in targets.items() if target is not None}
        for pool, target in wanted.items():
            if target < 0:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{POOL_NAMES[pool]} replicas must be >= 0")
        for pool, target in wanted.items():
            self.targets[pool] = target
            for listener in self.listeners:
                listener(pool, target)
        await self._reconcile(list(wanted), timeout_s)

    async def reconcile(self, timeout_s: float = 600.0) -> None:
        """Bring every pool back to its target: engines the router dropped (dead) are replaced."""
        await self._reconcile(list(self.targets), timeout_s)

    async def reconcile_pools(self, pools: list[int], timeout_s: float = 600.0) -> None:
        """Bring `pools` back to their targets."""
        await self._reconcile(pools, timeout_s)

    async def _reconcile(self, pools: list[int], timeout_s: float) -> None:
        per_pool = await asyncio.gather(*(self._reconcile_pool(p, timeout_s) for p in pools))
        errors = [e for pool_errors in per_pool for e in pool_errors]
        if errors:
            raise ServiceError(ErrorCode.INTERNAL, f"scaling failed: {errors[0]}")

    async def _reconcile_pool(self, pool: int, timeout_s: float) -> list[BaseException]:
        async with self._locks[pool]:  # the target is read under the lock: the latest one wins
            self._forget_lost(pool)
            mine = sorted((w for w, a in self.actors.items() if a.pool == pool), key=_seq)
            target = self.targets[pool]
            jobs = [self._start(pool) for _ in range(target - len(mine))]
            jobs += [self._drain(worker_id, timeout_s) for worker_id in mine[target:]]
            results = await asyncio.gather(*jobs, return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]

    def _forget_lost(self, pool: int) -> None:
        """Engines of `pool` the router dropped (they stopped answering) are replaced, not counted:
        a scale after a death does what it says."""
        from services.metrics.definitions import WORKER_RESTARTS

        for worker_id in [w for w, a in self.actors.items() if a.pool == pool and self._lost(w, a)]:
            logger.warning("%s stopped answering the router: replacing it", worker_id)
            self.forget(worker_id)
            WORKER_RESTARTS.labels(POOL_NAMES[pool]).inc()

    def needs_repair(self) -> bool:
        """An engine died, or a pool has fewer engines than its target (a start failed)."""
        sizes = self.pool_sizes()
        lost = any(self._lost(w, a) for w, a in self.actors.items())
        return lost or any(sizes[pool] < target for pool, target in self.targets.items())

    def pool_sizes(self) -> dict[int, int]:
        """Engine actors per pool now (starting and draining ones included)."""
        sizes = dict.fromkeys(self.targets, 0)
        for actor in self.actors.values():
            sizes[actor.pool] = sizes.get(actor.pool, 0) + 1
        return sizes

    # ---- one engine ------------------------------------------------------------------------------
    async def _start(self, pool: int) -> str:
        import ray

        from services.controller.node_worker_actor import NodeWorkerActor

        worker_id = f"{POOL_NAMES[pool]}-{next(self._ids)}"
        placement = self.spec.placements.get(pool, PoolPlacement())
        if self.spec.ep_sizes.get(pool, 1) > 1:
            return await self._start_instance(pool, worker_id, placement)
        options = placement.actor_options(self.spec.gpus_per_worker)
        handle = (
            ray.remote(NodeWorkerActor)
            .options(name=worker_id, max_concurrency=5, **options)  # one call is the death watch
            .remote(self._worker_spec(worker_id, pool))
        )
        self.actors[worker_id] = _Actor(pool, handle)
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            await self._placed(worker_id, pool, placement, handle, deadline)
            await asyncio.wait_for(handle.start.remote(), max(deadline - time.monotonic(), 1.0))
        except BaseException:
            self.actors.pop(worker_id, None)
            ray.kill(handle)
            raise
        finally:
            self._set_waiting(worker_id, None)
        self.actors[worker_id].registered = True
        self.healer.watch(worker_id, handle)
        logger.info("started %s (%s)", worker_id, options)
        return worker_id

    async def _start_instance(self, pool: int, instance_id: str, placement: PoolPlacement) -> str:
        """An expert-parallel instance: every rank placed, started and registered, or none left."""
        size = self.spec.ep_sizes[pool]
        # the pools file's GPUs are the engine's (all its ranks'); the command line's are each rank's
        gpus = self.spec.gpus_per_worker if placement.gpus is None else placement.gpus / size
        self.actors[instance_id] = _Actor(pool, None)
        try:
            instance = await start_instance(
                instance_id, size, lambda w: self._worker_spec(w, pool), gpus,
                placement.resource, self.spec.start_timeout_s, self.spec.join_timeout_s,
            )  # fmt: skip
        except BaseException:
            self.actors.pop(instance_id, None)
            raise
        self.actors[instance_id] = _Actor(pool, None, registered=True, instance=instance)
        self.healer.watch_instance(instance_id, [h for _, h in instance.ranks])
        return instance_id

    def _worker_spec(self, worker_id: str, pool: int) -> WorkerSpec:
        s = self.spec
        return WorkerSpec(
            worker_id=worker_id,
            pool=pool,
            engine_args=s.engine_args,
            model_name=s.model_name,
            host=s.host,
            router_address=self.router_address,
            cluster_token=s.cluster_token,
            reflection=s.reflection,
            torch_threads=s.torch_threads,
            log_level=s.log_level,
            encoder=s.encoder,
            stream_interval=s.stream_interval,
            grpc_server=s.grpc_server,
        )

    async def _placed(self, worker_id: str, pool: int, placement: PoolPlacement, handle, deadline: float) -> None:
        """Until Ray has placed the actor on a node; past the grace period, say why it waits."""
        ready = asyncio.ensure_future(_await(handle.__ray_ready__.remote()))
        try:
            await self._wait_placed(worker_id, pool, placement, ready, deadline)
        finally:
            if not ready.done():  # given up, or cancelled (shutdown): not left to fail unheard
                ready.cancel()
        ready.result()

    async def _wait_placed(self, worker_id, pool, placement, ready: asyncio.Future, deadline: float) -> None:
        import ray

        began = time.monotonic()
        while not (await asyncio.wait({ready}, timeout=1.0))[0]:
            waited = time.monotonic() - began
            if waited < self.spec.placement_grace_s:
                continue
            reason = unplaceable_reason(pool, placement, waited, await asyncio.to_thread(ray.nodes))
            if time.monotonic() > deadline:
                why = reason or f"it had not started after {waited:.0f}s"
                raise ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"{worker_id} was never placed: {why}")
            if reason is None:  # placed, still starting: nothing to report
                continue
            if worker_id not in self.waiting:
                logger.warning("%s: %s", worker_id, reason)
            self._set_waiting(worker_id, (pool, reason))

    def _set_waiting(self, worker_id: str, entry: Optional[tuple[int, str]]) -> None:
        """Record (or clear) why an engine waits for a node; the router's readiness detail and the
        metric say it per pool."""
        from services.metrics.autoscaler import AUTOSCALER_UNPLACED

        if entry is None:
            if self.waiting.pop(worker_id, None) is None:
                return
        else:
            self.waiting[worker_id] = entry
        by_pool: dict[int, list[str]] = defaultdict(list)
        for pool, reason in self.waiting.values():
            by_pool[pool].append(reason)
        for pool in {p for p, _ in self.waiting.values()} | set(self.targets):
            AUTOSCALER_UNPLACED.labels(POOL_NAMES[pool]).set(len(by_pool.get(pool, [])))
            key = f"placement:{POOL_NAMES[pool]}"
            if by_pool.get(pool):
                self.router.notes[key] = f"{by_pool[pool][-1]} ({len(by_pool[pool])} engine(s) waiting)"
            else:
                self.router.notes.pop(key, None)

    async def _drain(self, worker_id: str, timeout_s: float) -> None:
        actor = self.actors[worker_id]
        actor.draining = True
        deadline = time.monotonic() + timeout_s
        for rank_id in actor.worker_ids(worker_id):  # an instance leaves whole: every rank drains first
            await self._drain_worker(rank_id, actor, deadline, timeout_s)
        stops = [asyncio.wait_for(_await(h.stop.remote()), 30) for h in actor.handles()]  # ranks stop together
        for result in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(result, BaseException):  # already gone
                logger.warning("stopping %s: %s", worker_id, result)
        self.forget(worker_id)
        logger.info("drained and stopped %s", worker_id)

    async def _drain_worker(self, worker_id: str, actor: _Actor, deadline: float, timeout_s: float) -> None:
        registry = self.router.registry
        handle = registry.drain(worker_id)
        if handle is not None:
            try:
                await handle.client.drain(10.0)
                while handle.inflight > 0 or (await handle.client.stats(5.0)).requests > 0:
                    if time.monotonic() > deadline:
                        raise ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"{worker_id} did not drain in {timeout_s}s")
                    await asyncio.sleep(0.1)
            except ServiceError as e:
                if e.code != ErrorCode.UNAVAILABLE:  # a dead worker has nothing left to drain
                    actor.draining = False
                    raise
            await registry.remove(worker_id)

    def _lost(self, worker_id: str, actor: _Actor) -> bool:
        """A registered engine the router no longer lists (any rank of an instance), and not one being
        drained: it died."""
        workers = self.router.registry.workers
        return actor.registered and not actor.draining and any(w not in workers for w in actor.worker_ids(worker_id))

    def forget(self, worker_id: str) -> None:
        """Stop tracking (and kill) an engine's actor."""
        import ray

        self.healer.unwatch(worker_id)
        actor = self.actors.pop(worker_id, None)
        if actor is not None and actor.instance is not None:
            actor.instance.kill()  # every rank and the placement group
        elif actor is not None:
            try:
                ray.kill(actor.handle)
            except Exception:  # the actor is gone already
                pass

    async def shutdown(self) -> None:
        await self.healer.stop()  # the engines stopped below are not deaths to heal
        for worker_id in list(self.actors):
            self.forget(worker_id)


async def _await(ref):
    return await ref


def _seq(worker_id: str) -> int:
    """Newest workers are removed first."""
    return -int(worker_id.rsplit("-", 1)[1])
