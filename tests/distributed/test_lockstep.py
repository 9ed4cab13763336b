"""Lockstep with real processes (gloo): idle ranks run dummy steps, a NORMAL instance takes the
DP vote (SPEC §3) over the real group, and a killed or missing rank fails the instance within
its timeout instead of hanging it."""

import os
import signal
import time

import pytest

from deepinfer_core.distributed.lockstep import StepWatchdog
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.ep import RANK_ERROR, drive, make_rank_engine, run_ranks, serve_prompts

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
ALL_EVERY, ANY_EVERY = 3, 5
PEER_TIMEOUT_S = 2.0


def _reference(prompts, max_tokens) -> list[list[int]]:
    engine = make_engine(dtype="float32", num_gpu_blocks=128)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), params=greedy(max_tokens), prompt_token_ids=p)
    done = run_to_completion(engine)
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(prompts))]


def _vote_main(group, scenario: str) -> dict:
    """A NORMAL instance of two ranks with short vote intervals; traces (decode_step, prompt_run,
    scheduled) per step on each rank."""
    from deepinfer_core import envs
    from deepinfer_core.distributed.lockstep import LockstepRank

    os.environ["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] = str(ALL_EVERY)
    os.environ["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"] = str(ANY_EVERY)
    envs.rearm()
    engine = make_rank_engine(group)
    trace = []
    engine.post_schedule = lambda out: trace.append((engine.scheduler.decode_step, out.prompt_run,
                                                     len(out.scheduled_seqs)))  # fmt: skip
    lock = LockstepRank(engine, group)
    # rank 0 decodes a long request (prefilled at the first ANY point); the new prompts come later
    if group.rank == 0:
        engine.add_request("long", params=greedy(24), prompt_token_ids=PROMPTS[0])
    for _ in range(ANY_EVERY + 3):
        lock.step()
    if scenario == "lone" and group.rank == 1 or scenario == "both":
        engine.add_request(f"new{group.rank}", params=greedy(4), prompt_token_ids=PROMPTS[1 + group.rank])
    tokens = drive(lock, engine)
    lock.close()
    return {"trace": trace, "tokens": tokens}


def _scenarios_main(group) -> dict:
    """Every healthy-instance scenario on one pair of ranks (one spawn)."""
    return {
        "one_rank": serve_prompts(group, {}, {0: PROMPTS}, greedy(6)),
        **{s: _vote_main(group, s) for s in ("lone", "both")},
    }


@pytest.fixture(scope="module")
def scenarios():
    res = run_ranks(2, _scenarios_main, (), timeout_s=300)
    assert sorted(res) == [0, 1] and not any(isinstance(r, str) for r in res.values()), res
    return {name: {rank: res[rank][name] for rank in res} for name in res[0]}


@pytest.mark.timeout(400)
def test_requests_on_one_rank_the_other_runs_only_dummy_steps(scenarios):
    res = scenarios["one_rank"]
    assert res[0]["steps"] == res[1]["steps"] > 0  # every beat with work stepped both ranks
    assert res[1]["dummy_steps"] == res[1]["steps"]  # rank 1 had nothing: each of its steps was a dummy
    assert res[0]["tokens"] == {f"r0-{i}": t for i, t in enumerate(_reference(PROMPTS, 6))}


@pytest.mark.timeout(400)
def test_lone_prompt_waits_for_the_any_point_and_the_idle_rank_runs_an_empty_prefill(scenarios):
    r = scenarios["lone"]
    t0, t1 = r[0]["trace"], r[1]["trace"]
    assert [k for _, k, _ in t0] == [k for _, k, _ in t1], "both ranks take the same step kind"
    # trace entries hold decode_step after the schedule: entry i-1 has the count step i voted at
    prefills = [i for i, (_, kind, n) in enumerate(t1) if kind and n]
    assert len(prefills) == 1 and t1[prefills[0] - 1][0] % ANY_EVERY == 0  # rank 0 never wants at ALL points
    assert t0[prefills[0]][1:] == (True, 0), "rank 0 ran an empty prefill step beside it"
    assert r[1]["tokens"]["new1"] == _reference([PROMPTS[2]], 4)[0]
    assert r[0]["tokens"]["long"] == _reference([PROMPTS[0]], 24)[0]


@pytest.mark.timeout(400)
def test_prompts_on_every_rank_prefill_at_an_all_point(scenarios):
    r = scenarios["both"]
    t0, t1 = r[0]["trace"], r[1]["trace"]
    assert [k for _, k, _ in t0] == [k for _, k, _ in t1]
    both = [i for i in range(len(t0)) if t0[i][1] and t0[i][2] and t1[i][2]]
    assert len(both) == 1, "one prefill step took both ranks' prompts"
    assert t0[both[0] - 1][0] % ALL_EVERY == 0 and t0[both[0] - 1][0] % ANY_EVERY != 0  # an ALL point
    assert r[0]["tokens"]["new0"] == _reference([PROMPTS[1]], 4)[0]


def _killed_main(group, kill_rank: int, kill_at_beat: int) -> dict:
    """Both ranks serve; `kill_rank` SIGKILLs itself mid-run; the survivor reports how it ended."""
    from deepinfer_core.distributed.group import InstanceFailed
    from deepinfer_core.distributed.lockstep import LockstepRank

    engine = make_rank_engine(group)
    noticed = []  # the peer monitor's report: (message, when)
    lock = LockstepRank(engine, group, peer_timeout_s=PEER_TIMEOUT_S,
                        on_stuck=lambda msg: noticed.append((msg, time.monotonic())))  # fmt: skip
    engine.add_request("a", params=greedy(200), prompt_token_ids=PROMPTS[group.rank])
    killed_at = None
    try:
        for beat in range(10_000):
            if beat == kill_at_beat:
                killed_at = time.monotonic()
                if group.rank == kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
            lock.step()
        return {"failed": None}
    except InstanceFailed as e:
        return {"failed": str(e), "after_s": time.monotonic() - killed_at, "stays_failed": _stays_failed(lock),
                "noticed": [(msg, t - killed_at) for msg, t in noticed]}  # fmt: skip


def _stays_failed(lock) -> bool:
    from deepinfer_core.distributed.group import InstanceFailed

    try:
        lock.step()
    except InstanceFailed:
        return True
    return False


@pytest.mark.timeout(240)
def test_a_killed_rank_fails_the_instance_within_the_collective_timeout():
    timeout_s = 15.0
    res = run_ranks(2, _killed_main, (1, 5), timeout_s=120, collective_timeout_s=timeout_s)
    assert 1 not in res  # the killed rank never reports
    survivor = res[0]
    assert isinstance(survivor, dict), survivor
    assert survivor["failed"] and "rank 0/2" in survivor["failed"], survivor
    assert survivor["after_s"] < timeout_s + 5
    assert survivor["stays_failed"]
    # gloo saw the closed socket, or the peer monitor the missing beats, well before the collective timeout
    noticed = [after for _, after in survivor["noticed"]]
    assert min([survivor["after_s"], *noticed]) < PEER_TIMEOUT_S + 3


def _silent_peer_main(group) -> list:
    """Rank 1 stops beating (as a frozen or killed process would); rank 0's monitor reports it."""
    from deepinfer_core.distributed.lockstep import PeerMonitor

    noticed = []
    start = time.monotonic()
    monitor = PeerMonitor(group, PEER_TIMEOUT_S, on_stuck=lambda msg: noticed.append((msg, time.monotonic() - start)))
    if group.rank == 1:
        monitor.close()
    deadline = time.monotonic() + 4 * PEER_TIMEOUT_S
    while group.rank == 0 and not noticed and time.monotonic() < deadline:
        time.sleep(0.1)
    group.any(True)  # rank 1 leaves only after rank 0 has its answer
    monitor.close()
    return noticed


@pytest.mark.timeout(120)
def test_the_peer_monitor_reports_a_rank_that_stopped_beating():
    res = run_ranks(2, _silent_peer_main, (), timeout_s=90)
    assert res[1] == []
    (message, after_s), *_ = res[0]
    assert "rank 0/2: rank 1 stopped answering" in message and PEER_TIMEOUT_S <= after_s < PEER_TIMEOUT_S + 3


def _joined(group) -> str:
    return "joined"


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_fails_the_start_naming_it():
    start = time.monotonic()
    res = run_ranks(3, _joined, (), timeout_s=60, join_timeout_s=3.0, ranks=[0, 1])
    assert time.monotonic() - start < 40
    for r in (0, 1):
        assert res[r].startswith(RANK_ERROR) and "rank(s) [2] of 3 did not join" in res[r], res[r]


def test_watchdog_reports_a_stuck_step():
    stuck = []
    dog = StepWatchdog(0.2, "rank 0/2", on_stuck=stuck.append)
    dog.begin()
    deadline = time.monotonic() + 5
    while not stuck and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.close()
    assert stuck and "stuck for more than" in stuck[0]


def test_watchdog_stays_quiet_between_steps():
    stuck = []
    dog = StepWatchdog(0.2, "rank 0/2", on_stuck=stuck.append)
    dog.begin()
    dog.end()
    time.sleep(0.5)
    dog.close()
    assert not stuck
