"""Self-healing pools: an engine actor that dies is out of routing at once and replaced.

The controller watches each engine it started with a call that returns only when the engine
stops (`WorkerActor.watch`): Ray fails that call as soon as the actor's process is gone (kill -9,
a crash, its node lost), within about a second, without waiting for the router's health polls.
An expert-parallel instance is watched through every rank: the first rank whose actor stops fails
the whole instance (its peers cannot step without it), and the instance is replaced whole.
The dead engine is removed from the router's registry (no request is routed to it; its PEs let go
of its transfer agent) and forgotten, and the pool is brought back to its target, with backoff
when starts keep failing (`deepinfer:worker_restarts_total{pool}` counts the replacements). An
engine that stops answering without dying is the planner's to find (`ClusterController.reconcile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from services.common.workers import POOL_NAMES

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
"""Waits between attempts to replace an engine when starts fail: doubling from the first to the max."""


class PoolHealer:
    def __init__(self, controller):
        self.controller = controller
        self._watches: dict[str, asyncio.Task] = {}
        """worker id -> the task waiting for its actor to stop."""
        self._heals: dict[int, asyncio.Task] = {}
        """pool -> the task bringing it back to its target."""

    def watch(self, worker_id: str, handle: Any) -> None:
        """Watch a started engine: if its actor dies, heal its pool."""
        self._watches[worker_id] = asyncio.ensure_future(self._watch(worker_id, handle))

    def watch_instance(self, instance_id: str, handles: list[Any]) -> None:
        """Watch every rank of an instance: when any one stops, the instance is dead."""
        self._watches[instance_id] = asyncio.ensure_future(self._watch_ranks(instance_id, handles))

    def unwatch(self, worker_id: str) -> None:
        task = self._watches.pop(worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _watch(self, worker_id: str, handle: Any) -> None:
        why = await _watched(handle)
        self._watches.pop(worker_id, None)
        await self.engine_died(worker_id, why)

    async def _watch_ranks(self, instance_id: str, handles: list[Any]) -> None:
        ranks = [asyncio.ensure_future(_watched(h)) for h in handles]
        try:
            done, _ = await asyncio.wait(ranks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in ranks:
                task.cancel()
        first = next(iter(done))
        self._watches.pop(instance_id, None)
        await self.engine_died(instance_id, f"rank {ranks.index(first)}: {first.result()}")

    async def engine_died(self, worker_id: str, why: str) -> None:
        """An engine is gone (or is to be treated so): out of routing now, its pool healed."""
        controller = self.controller
        actor = controller.actors.get(worker_id)
        if actor is None or actor.draining:  # stopped on purpose (scaled in, shut down)
            return
        pool = actor.pool
        logger.warning("%s died (%s): removing it from routing and starting a replacement", worker_id, why)
        for rank_id in actor.worker_ids(worker_id):  # every rank of an instance leaves routing
            await controller.router.registry.remove(rank_id)
            controller.router.registry.declare_dead(rank_id)  # its fenced reservations can go
        controller.forget(worker_id)
        self.replaced(pool)

    def replaced(self, pool: int, count: int = 1) -> None:
        """`count` engines of `pool` are gone for good: count the restarts and heal the pool."""
        from services.metrics.definitions import WORKER_RESTARTS

        WORKER_RESTARTS.labels(POOL_NAMES[pool]).inc(count)
        task = self._heals.get(pool)
        if task is None or task.done():
            self._heals[pool] = asyncio.ensure_future(self._heal(pool))

    async def _heal(self, pool: int) -> None:
        """Start engines until the pool is at its target again; wait longer after each failure."""
        controller = self.controller
        delay = 0.0
        while controller.pool_sizes().get(pool, 0) < controller.targets.get(pool, 0):
            if delay:
                await asyncio.sleep(delay)
            try:
                await controller.reconcile_pools([pool])
            except Exception as e:  # the next attempt waits longer
                delay = min(max(2 * delay, BACKOFF_FIRST_S), BACKOFF_MAX_S)
                logger.warning("replacing a %s engine failed (next try in %.0fs): %s", POOL_NAMES[pool], delay, e)
            else:
                delay = 0.0

    def healing(self) -> bool:
        """A pool is being brought back to its target now."""
        return any(not t.done() for t in self._heals.values())

    async def stop(self) -> None:
        tasks = [*self._watches.values(), *self._heals.values()]
        self._watches.clear()
        self._heals.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _watched(handle: Any) -> str:
    """Returns once the actor has stopped: why."""
    try:
        await handle.watch.remote()
        return "it stopped"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # RayActorError and kin: the process is gone
        return type(e).__name__
