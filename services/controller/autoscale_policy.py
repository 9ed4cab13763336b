"""The autoscaling policy of one pool: from the pool's own load to the number of engines it needs.

Each pool is judged on its own signal only, so a decode bottleneck never grows the prefill pool and
a prefill backlog never grows the decode pool:

- prefill: prompt tokens queued in its engines, per engine;
- decode: running + waiting requests per engine, and the KV its decoding sequences hold. KV that
  decode engines reserve for prefills still in flight is a prefill backlog, not decode load: it is
  taken out in proportion to the reservations' count (the engines report one KV figure);
- colocated (NORMAL engines do both): the larger of the two.

The load over what the pool's engines are meant to carry is its utilization `u` (1.0 = on target);
the engines counted are those the controller wants, so engines still starting count as capacity and
a slow start is not answered with a second scale-out. Then:

- scale out when `u > 1 + tolerance`, to `ceil(engines * u)` (at least one more, at most `max_step`
  more), unless the pool changed less than `scale_out_cooldown_s` ago;
- scale in by one engine when the load spread over one engine fewer stays under `scale_in_below`
  (that gap to the scale-out point is the hysteresis: after scaling in the pool is not over its
  target), has stayed there for `scale_in_stable_s`, and the pool last changed at least
  `scale_in_cooldown_s` ago;
- a size outside `[min_replicas, max_replicas]` is brought back at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from services.common.workers import POOL_COLOCATED, POOL_NAMES, POOL_PREFILL

UP, DOWN, HOLD = "up", "down", "hold"


@dataclass(frozen=True)
class PoolSignals:
    """One pool's load, summed over its ready engines (read from the router's registry)."""

    engines: int = 0
    """Ready engines that reported it."""
    queued_prompt_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    reservations: int = 0
    """Decode: KV reservations whose prefill has not handed off yet."""
    kv_used: float = 0.0
    """Sum of the engines' KV usage (1.0 = one engine's cache full)."""


@dataclass(frozen=True)
class ScalingRule:
    """Bounds, targets and clocks of one pool's policy."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_queued_prompt_tokens: int = 8192
    """Prefill: queued prompt tokens one engine should carry."""
    target_requests: int = 64
    """Decode: running + waiting requests one engine should carry."""
    target_kv_usage: float = 0.8
    """Decode: the KV usage one engine should stay under."""
    tolerance: float = 0.1
    """No scale-out until the utilization is this far over 1."""
    scale_in_below: float = 0.6
    """Scale in only while the load over one engine fewer would be under this utilization."""
    scale_out_cooldown_s: float = 30.0
    scale_in_cooldown_s: float = 120.0
    scale_in_stable_s: float = 60.0
    """How long the load must have allowed a scale-in before one is made."""
    max_step: int = 2
    """Most engines one scale-out adds."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if not 0 < self.scale_in_below < 1:
            raise ValueError(f"scale_in_below must be in (0, 1), got {self.scale_in_below}")
        if min(self.target_queued_prompt_tokens, self.target_requests, self.max_step) < 1:
            raise ValueError("targets and max_step must be at least 1")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {self.target_kv_usage}")


@dataclass(frozen=True)
class Decision:
    pool: int
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return UP if self.target > self.current else DOWN if self.target < self.current else HOLD


def utilization(pool: int, s: PoolSignals, rule: ScalingRule, engines: int) -> tuple[float, str]:
    """The pool's load over what `engines` engines should carry, and how it was reckoned."""
    engines = max(engines, 1)
    prefill = s.queued_prompt_tokens / (engines * rule.target_queued_prompt_tokens)
    prefill_why = f"{s.queued_prompt_tokens} queued prompt tokens"
    if pool == POOL_PREFILL:
        return prefill, prefill_why
    active = s.running_requests + s.waiting_requests
    decode_kv = s.kv_used * active / (active + s.reservations) if active else 0.0
    requests = active / (engines * rule.target_requests)
    kv = decode_kv / (engines * rule.target_kv_usage)
    decode_why = f"{active} running + waiting requests, KV {decode_kv:.2f} engine(s) in use"
    if pool == POOL_COLOCATED and prefill > max(requests, kv):
        return prefill, prefill_why
    return max(requests, kv), decode_why


class PoolAutoscaler:
    """The policy's memory for one pool: when it last changed, since when it could shrink."""

    def __init__(self, pool: int, rule: ScalingRule, clock: Callable[[], float]):
        self.pool = pool
        self.rule = rule
        self.clock = clock
        self.last_change = -math.inf
        self._low_since: Optional[float] = None

    def changed(self) -> None:
        """The pool's size was changed (by this policy or by hand): the cool-downs start again."""
        self.last_change = self.clock()
        self._low_since = None

    def decide(self, current: int, signals: PoolSignals) -> Decision:
        """The size the pool should have now, with the reason (target == current: no change)."""
        rule, now, name = self.rule, self.clock(), POOL_NAMES[self.pool]
        if not rule.min_replicas <= current <= rule.max_replicas:
            target = min(max(current, rule.min_replicas), rule.max_replicas)
            return self._decision(
                current, target, f"{name}: {current} engine(s) is outside [{rule.min_replicas}, {rule.max_replicas}]"
            )
        u, why = utilization(self.pool, signals, rule, current)
        shrunk = u * current / (current - 1) if current > 1 else math.inf
        self._low_since = (
            (self._low_since if self._low_since is not None else now) if shrunk < rule.scale_in_below else None
        )
        said = f"{name}: {why} over {current} engine(s): utilization {u:.2f}"
        if u > 1 + rule.tolerance and current < rule.max_replicas:
            if now - self.last_change < rule.scale_out_cooldown_s:
                return self._decision(current, current, f"{said}; scale-out cooling down")
            target = min(max(math.ceil(current * u), current + 1), current + rule.max_step, rule.max_replicas)
            return self._decision(current, target, f"{said} > {1 + rule.tolerance:.2f}")
        if self._low_since is not None and current > rule.min_replicas:
            if now - self.last_change < rule.scale_in_cooldown_s or now - self._low_since < rule.scale_in_stable_s:
                return self._decision(current, current, f"{said}; scale-in waiting (cool-down or stability window)")
            return self._decision(
                current, current - 1, f"{said}, {shrunk:.2f} over one engine fewer < {rule.scale_in_below:.2f}"
            )
        return self._decision(current, current, said)

    def _decision(self, current: int, target: int, reason: str) -> Decision:
        return Decision(self.pool, current, target, reason)
