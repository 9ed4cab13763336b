"""ClusterController: the worker pools as Ray actors — start them, scale them, drain them.

Scaling up starts actors that register with the router themselves. Scaling down drains:
the router stops sending work to the worker, the worker refuses new work, and the actor is
stopped only once the router has nothing in flight there and the engine holds no request —
no request is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_NAMES
from services.router.core import RouterCore
from services.workers.spec import EngineSettings, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass
class PoolSpec:
    """How to build the workers of the cluster."""

    engine_args: EngineSettings = EngineSettings()
    model_name: str = ""
    host: str = "127.0.0.1"
    torch_threads: int = 1
    gpus_per_worker: float = 0.0
    log_level: str = "WARNING"


@dataclass
class _Actor:
    pool: int
    handle: Any
    """The Ray actor."""


class ClusterController:
    def __init__(self, spec: PoolSpec, router: RouterCore, router_address: str):
        self.spec = spec
        self.router = router
        self.router_address = router_address
        self.targets: dict[int, int] = {}
        self.actors: dict[str, _Actor] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()

    async def scale(self, targets: dict[int, Optional[int]], timeout_s: float = 600.0) -> None:
        """Set replica counts (None = unchanged); returns when new workers are ready and removed
        ones have drained and stopped."""
        async with self._lock:
            jobs = []
            for pool, target in targets.items():
                if target is None:
                    continue
                if target < 0:
                    raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{POOL_NAMES[pool]} replicas must be >= 0")
                self.targets[pool] = target
                mine = [wid for wid, a in self.actors.items() if a.pool == pool]
                jobs += [self._start(pool) for _ in range(target - len(mine))]
                jobs += [self._drain(wid, timeout_s) for wid in sorted(mine, key=_seq)[target:]]
            results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ServiceError(ErrorCode.INTERNAL, f"scaling failed: {errors[0]}")

    async def _start(self, pool: int) -> str:
        import ray

        from services.workers.worker_server import WorkerActor

        worker_id = f"{POOL_NAMES[pool]}-{next(self._ids)}"
        spec = WorkerSpec(
            worker_id=worker_id,
            pool=pool,
            engine_args=self.spec.engine_args,
            model_name=self.spec.model_name,
            host=self.spec.host,
            router_address=self.router_address,
            torch_threads=self.spec.torch_threads,
            log_level=self.spec.log_level,
        )
        actor_cls = ray.remote(WorkerActor).options(
            name=worker_id, num_cpus=0, num_gpus=self.spec.gpus_per_worker, max_concurrency=4
        )
        handle = actor_cls.remote(spec)
        self.actors[worker_id] = _Actor(pool, handle)
        try:
            await handle.start.remote()
        except Exception:
            self.actors.pop(worker_id, None)
            ray.kill(handle)
            raise
        logger.info("started %s", worker_id)
        return worker_id

    async def _drain(self, worker_id: str, timeout_s: float) -> None:
        import ray

        actor = self.actors[worker_id]
        registry = self.router.registry
        handle = registry.drain(worker_id)
        deadline = time.monotonic() + timeout_s
        if handle is not None:
            try:
                await handle.client.drain(10.0)
                while handle.inflight > 0 or (await handle.client.stats(5.0)).requests > 0:
                    if time.monotonic() > deadline:
                        raise ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"{worker_id} did not drain in {timeout_s}s")
                    await asyncio.sleep(0.1)
            except ServiceError as e:
                if e.code != ErrorCode.UNAVAILABLE:  # a dead worker has nothing left to drain
                    raise
            await registry.remove(worker_id)
        try:
            await asyncio.wait_for(actor.handle.stop.remote(), 30)
        except Exception as e:  # already gone
            logger.warning("stopping %s: %s", worker_id, e)
        ray.kill(actor.handle)
        self.actors.pop(worker_id, None)
        logger.info("drained and stopped %s", worker_id)

    async def shutdown(self) -> None:
        import ray

        for actor in list(self.actors.values()):
            try:
                ray.kill(actor.handle)
            except Exception:
                pass
        self.actors.clear()


def _seq(worker_id: str) -> int:
    """Newest workers are removed first."""
    return -int(worker_id.rsplit("-", 1)[1])
