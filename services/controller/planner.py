"""The planner: the controller's loop that decides pool sizes and keeps the pools at them.

Every `interval_s` it reads each pool's load from the router's registry (the `WorkerLoad`s the
router polls), asks the pool's policy (`autoscale_policy.py`) for a size when autoscaling is on,
and hands a change to the controller, which starts (with the pool's Ray resource) or drains and
stops engines. A pool whose change is still under way is not judged again until it is done, and
each pool changes on its own: a decode scale-out waiting minutes for a new pod does not hold up the
prefill pool. Engines the router dropped (they stopped answering) are replaced. Every decision is
logged with its reason and exported (`deepinfer:autoscaler_desired_replicas{pool}`,
`deepinfer:autoscaler_decisions_total{pool,direction}`); a size set by hand (`deepinfer scale`)
restarts the pool's cool-downs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Optional

from services.common.workers import POOL_NAMES
from services.controller.autoscale_policy import HOLD, Decision, PoolAutoscaler, PoolSignals
from services.controller.controller import ClusterController
from services.controller.pools_config import PlannerSettings, PoolsConfig, load_pools_config, with_placements
from services.router.registry import PoolRegistry

logger = logging.getLogger(__name__)

SignalSource = Callable[[int], PoolSignals]
"""pool -> its load now."""


def registry_signals(registry: PoolRegistry, ep_sizes: Optional[dict[int, int]] = None) -> SignalSource:
    """Each pool's load summed over its ready engines' last reports. In a pool of expert-parallel
    instances (`ep_sizes`: ranks per instance) each rank reports its own load; the engine the policy
    counts is the instance: its KV cache is its ranks' caches together (1.0 = every rank full)."""
    ep_sizes = ep_sizes or {}

    def signals(pool: int) -> PoolSignals:
        loads = [h.load for h in registry.pool(pool)]
        ranks = ep_sizes.get(pool, 1)
        return PoolSignals(
            engines=len(loads) // ranks,
            queued_prompt_tokens=sum(x.queued_prompt_tokens for x in loads),
            running_requests=sum(x.running_requests for x in loads),
            waiting_requests=sum(x.waiting_requests for x in loads),
            reservations=sum(x.reservations for x in loads),
            kv_used=sum(x.kv_usage for x in loads) / ranks,
        )

    return signals


class Planner:
    def __init__(
        self,
        controller: ClusterController,
        config: PoolsConfig,
        autoscale: bool,
        clock: Callable[[], float] = time.monotonic,
        signals: Optional[SignalSource] = None,
    ):
        self.controller = controller
        self.settings: PlannerSettings = config.planner
        self.autoscalers = {p: PoolAutoscaler(p, rule, clock) for p, rule in config.rules.items()} if autoscale else {}
        self.signals = signals or registry_signals(controller.router.registry, controller.spec.ep_sizes)
        self.decisions: list[Decision] = []
        """Every change decided, oldest first."""
        self._changes: dict[int, asyncio.Task] = {}
        self._repair: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.Task] = None
        controller.listeners.append(self._target_set)
        for pool, target in controller.targets.items():
            self._target_set(pool, target)

    def _target_set(self, pool: int, target: int) -> None:
        from services.metrics.autoscaler import AUTOSCALER_DESIRED_REPLICAS

        AUTOSCALER_DESIRED_REPLICAS.labels(POOL_NAMES[pool]).set(target)
        if pool in self.autoscalers:
            self.autoscalers[pool].changed()

    def start(self) -> None:
        self._loop = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # the loop must outlive one bad round
                logger.exception("planner round failed")
            await asyncio.sleep(self.settings.interval_s)

    def step(self) -> list[Decision]:
        """One round: replace lost engines, then judge each idle pool; returns the changes started."""
        if self.settings.replace_dead and not self._busy() and self.controller.needs_repair():
            self._repair = asyncio.ensure_future(self._guarded(self.controller.reconcile(), "replacing engines"))
        started = []
        for pool, autoscaler in self.autoscalers.items():
            current = self.controller.targets.get(pool)
            if current is None or self._busy(pool):
                continue
            decision = autoscaler.decide(current, self.signals(pool))
            if decision.direction == HOLD:
                logger.debug("%s", decision.reason)
                continue
            self._record(decision)
            self._changes[pool] = asyncio.ensure_future(
                self._guarded(self.controller.scale({pool: decision.target}), f"scaling {POOL_NAMES[pool]}")
            )
            started.append(decision)
        return started

    def _record(self, decision: Decision) -> None:
        from services.metrics.autoscaler import AUTOSCALER_DECISIONS

        name = POOL_NAMES[decision.pool]
        logger.warning("autoscaler: %s %s -> %s: %s", name, decision.current, decision.target, decision.reason)
        AUTOSCALER_DECISIONS.labels(name, decision.direction).inc()
        self.decisions.append(decision)

    def _busy(self, pool: Optional[int] = None) -> bool:
        tasks = [self._repair] + ([self._changes.get(pool)] if pool is not None else list(self._changes.values()))
        return any(t is not None and not t.done() for t in tasks)

    async def _guarded(self, job, what: str) -> None:
        try:
            await job
        except Exception as e:  # reported; the next round tries again
            logger.warning("planner: %s failed: %s", what, e)

    async def stop(self) -> None:
        if self._target_set in self.controller.listeners:
            self.controller.listeners.remove(self._target_set)
        for task in [self._loop, self._repair, *self._changes.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def start_planner(controller: ClusterController, pools_config: Optional[str], autoscale: bool) -> Planner:
    """The head's planner: the pools file's placements go to the controller before any engine
    starts. It always runs: without a pools file or autoscaling it only replaces engines the router
    dropped (they stopped answering; engines that die outright the controller replaces at once)."""
    config = load_pools_config(pools_config) if pools_config else PoolsConfig()
    if autoscale and not config.rules:
        raise ValueError("--autoscale needs the pools' bounds: give --pools-config with an autoscaling block per pool")
    controller.spec = with_placements(controller.spec, config)
    planner = Planner(controller, config, autoscale)
    planner.start()
    return planner
