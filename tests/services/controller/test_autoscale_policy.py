"""The autoscaling policy on a fake clock: bounds, cool-downs, hysteresis, the stability window,
and each pool judged on its own signal only."""

import pytest

from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL
from services.controller.autoscale_policy import DOWN, HOLD, UP, PoolAutoscaler, PoolSignals, ScalingRule

RULE = ScalingRule(
    min_replicas=1,
    max_replicas=4,
    target_requests=4,
    target_kv_usage=0.8,
    target_queued_prompt_tokens=1000,
    scale_out_cooldown_s=30,
    scale_in_cooldown_s=120,
    scale_in_stable_s=60,
    max_step=2,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def decode_load(requests: int, kv: float = 0.0, reservations: int = 0) -> PoolSignals:
    return PoolSignals(engines=1, running_requests=requests, reservations=reservations, kv_used=kv)


def policy(pool=POOL_DECODE, rule=RULE):
    clock = Clock()
    return PoolAutoscaler(pool, rule, clock), clock


def test_a_decode_queue_scales_out_at_most_max_step_and_never_past_max():
    auto, _ = policy()
    d = auto.decide(1, decode_load(requests=40))  # utilization 10
    assert (d.direction, d.target) == (UP, 3) and "40 running + waiting" in d.reason
    assert auto.decide(3, decode_load(requests=40)).target == 4  # max_replicas
    assert auto.decide(4, decode_load(requests=400)).direction == HOLD


def test_kv_usage_alone_scales_decode_out():
    auto, _ = policy()
    d = auto.decide(2, PoolSignals(engines=2, running_requests=2, kv_used=1.9))  # 0.95 per engine > 0.8
    assert d.direction == UP and d.target == 3


def test_bounds_win_at_once_whatever_the_cool_down():
    auto, _ = policy()
    auto.changed()
    assert auto.decide(0, PoolSignals()).target == 1 and "outside [1, 4]" in auto.decide(0, PoolSignals()).reason
    assert auto.decide(7, decode_load(requests=100)).target == 4


def test_scale_out_waits_for_its_cool_down():
    auto, clock = policy()
    auto.changed()
    clock.now += 29
    d = auto.decide(1, decode_load(requests=20))
    assert d.direction == HOLD and "cooling down" in d.reason
    clock.now += 2
    assert auto.decide(1, decode_load(requests=20)).direction == UP


def test_scale_in_needs_the_cool_down_and_a_stable_low_load():
    auto, clock = policy()
    auto.changed()
    low = PoolSignals(engines=3, running_requests=1)
    for _ in range(12):  # 110 s of low load, inside the 120 s cool-down
        assert auto.decide(3, low).direction == HOLD
        clock.now += 10
    clock.now += 10  # cool-down over, low for 120 s > 60 s
    d = auto.decide(3, low)
    assert (d.direction, d.target) == (DOWN, 2) and "one engine fewer" in d.reason


def test_a_load_spike_restarts_the_stability_window():
    auto, clock = policy(rule=ScalingRule(target_requests=4, scale_in_cooldown_s=0, scale_in_stable_s=60))
    low, middling = PoolSignals(running_requests=1), PoolSignals(running_requests=7)
    for t in range(0, 50, 10):
        clock.now = 2000 + t
        assert auto.decide(2, low).direction == HOLD
    clock.now = 2050
    assert auto.decide(2, middling).direction == HOLD  # 7 over 1 engine would be 1.75: no scale-in, no out
    for t in range(60, 120, 10):
        clock.now = 2000 + t
        assert auto.decide(2, low).direction == HOLD  # low again since t=60: the window starts over
    clock.now = 2120
    assert auto.decide(2, low).direction == DOWN


def test_hysteresis_keeps_a_load_between_the_thresholds_where_it_is():
    """Between 'over one engine fewer it would be under scale_in_below' and 'over 1 + tolerance' the
    pool holds, however long; a load at which it scaled in does not push it back out."""
    auto, clock = policy(
        rule=ScalingRule(target_requests=10, scale_out_cooldown_s=0, scale_in_cooldown_s=0, scale_in_stable_s=0)
    )
    for requests in [12, 18, 21, 14, 19, 13] * 5:  # 2 engines: utilization 0.6-1.05
        assert auto.decide(2, PoolSignals(running_requests=requests)).direction == HOLD
        clock.now += 10
    d = auto.decide(3, PoolSignals(running_requests=11))  # 11 over 2 engines = 0.55 < 0.6
    assert d.target == 2
    assert auto.decide(2, PoolSignals(running_requests=11)).direction == HOLD  # 0.55 at 2: no flap back


def test_a_decode_bottleneck_never_scales_prefill_and_a_prefill_backlog_never_scales_decode():
    prefill, _ = policy(POOL_PREFILL)
    decode, _ = policy(POOL_DECODE)
    decode_bottleneck = PoolSignals(engines=1, running_requests=50, waiting_requests=30, kv_used=1.0)
    assert prefill.decide(1, decode_bottleneck).direction == HOLD
    assert decode.decide(1, decode_bottleneck).direction == UP
    # a prefill backlog: prompt tokens queued in the PEs; the CEs hold reservations (KV) for them
    backlog_pe = PoolSignals(engines=1, queued_prompt_tokens=5000)
    backlog_ce = PoolSignals(engines=1, reservations=40, kv_used=0.9)
    assert (
        prefill.decide(1, backlog_pe).direction == UP
        and "5000 queued prompt tokens" in prefill.decide(1, backlog_pe).reason
    )
    assert decode.decide(1, backlog_ce).direction == HOLD
    mixed = PoolSignals(engines=1, running_requests=2, reservations=38, kv_used=0.95)  # KV mostly reservations
    assert decode.decide(1, mixed).direction == HOLD


def test_colocated_engines_answer_to_the_larger_of_both_signals():
    auto, _ = policy(POOL_COLOCATED)
    assert auto.decide(1, PoolSignals(queued_prompt_tokens=3000)).direction == UP
    assert auto.decide(1, PoolSignals(running_requests=20)).direction == UP
    assert auto.decide(1, PoolSignals(running_requests=1, queued_prompt_tokens=10)).direction == HOLD


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_replicas=0),
        dict(min_replicas=3, max_replicas=2),
        dict(scale_in_below=1.0),
        dict(target_kv_usage=0),
        dict(max_step=0),
    ],
)
def test_rules_that_cannot_work_are_refused(kwargs):
    with pytest.raises(ValueError):
        ScalingRule(**kwargs)
