"""The planner on the multi-node Ray cluster, driven by a synthetic decode queue on top of the
router's real load reports: the decode pool grows under the queue and shrinks after it drains, the
prefill pool does not move, and the decisions are exported."""

from __future__ import annotations

import dataclasses
import time

import pytest
from prometheus_client import REGISTRY

from services.common.workers import POOL_DECODE, POOL_PREFILL
from services.controller.autoscale_policy import DOWN, UP, ScalingRule
from services.controller.planner import Planner, registry_signals
from services.controller.pools_config import PlannerSettings, PoolsConfig

pytestmark = pytest.mark.slow

RULE = ScalingRule(
    min_replicas=1,
    max_replicas=2,
    target_requests=4,
    scale_out_cooldown_s=0,
    scale_in_cooldown_s=2,
    scale_in_stable_s=2,
)


def _decisions(pool: str, direction: str) -> float:
    labels = {"pool": pool, "direction": direction}
    return REGISTRY.get_sample_value("deepinfer:autoscaler_decisions_total", labels) or 0.0


def test_the_decode_pool_follows_a_decode_queue_and_the_prefill_pool_holds(groups):
    controller = groups.controller
    groups.run(controller.scale({POOL_PREFILL: 1, POOL_DECODE: 1}))
    queue = {"waiting": 0}
    real = registry_signals(groups.head.router.registry)

    def signals(pool: int):
        load = real(pool)
        if pool == POOL_DECODE:  # requests waiting in the decode engines, on top of what they report
            return dataclasses.replace(load, waiting_requests=load.waiting_requests + queue["waiting"])
        return load

    async def start() -> Planner:
        settings = PlannerSettings(interval_s=0.3, replace_dead=False)
        planner = Planner(
            controller, PoolsConfig(rules={POOL_PREFILL: RULE, POOL_DECODE: RULE}, planner=settings), True
        )
        planner.signals = signals
        planner.start()
        return planner

    ups, downs = _decisions("decode", "up"), _decisions("decode", "down")
    planner = groups.run(start())
    samples = []  # (seconds, prefill target, decode target, ready prefill, ready decode)

    def until(predicate, timeout_s: float) -> bool:
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            ready = groups.ready_sizes()
            targets = controller.targets
            samples.append((time.monotonic(), targets[POOL_PREFILL], targets[POOL_DECODE], *ready.values()))
            if predicate(ready):
                return True
            time.sleep(0.25)
        return False

    try:
        assert until(lambda r: False, 1.5) is False  # idle: nothing moves
        queue["waiting"] = 20  # five engines' worth over one engine: capped at max_replicas
        assert until(lambda r: r[POOL_DECODE] == 2, 180), samples[-1]
        queue["waiting"] = 0
        assert until(lambda r: r[POOL_DECODE] == 1 and controller.pool_sizes()[POOL_DECODE] == 1, 180), samples[-1]
    finally:
        groups.run(planner.stop())
    decode_targets = [s[2] for s in samples]
    assert decode_targets[0] == 1 and max(decode_targets) == 2 and decode_targets[-1] == 1
    first_two = decode_targets.index(2)
    assert set(decode_targets[first_two : decode_targets.index(1, first_two)]) == {2}  # no flapping in between
    assert {s[1] for s in samples} == {1} and {s[3] for s in samples} == {1}  # prefill never moved
    assert [(d.pool, d.direction) for d in planner.decisions] == [(POOL_DECODE, UP), (POOL_DECODE, DOWN)]
    assert "20 running + waiting requests" in planner.decisions[0].reason
    assert _decisions("decode", "up") == ups + 1 and _decisions("decode", "down") == downs + 1
    assert _decisions("prefill", "up") == 0 and _decisions("prefill", "down") == 0
    assert REGISTRY.get_sample_value("deepinfer:autoscaler_desired_replicas", {"pool": "decode"}) == 1
