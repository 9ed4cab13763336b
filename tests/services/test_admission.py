"""Admission by work against `--max-concurrent-requests/-sequences/-prompt-tokens`: one process's
counts, and the counts that every API process of one server shares (`SharedCounts`), across real
processes: the limits hold on the sums, a dead process's work can be zeroed, one killed while it
holds the lock wedges nobody, and Retry-After follows the rate at which work drains."""

import fcntl
import multiprocessing
import os
import signal
import time

from prometheus_client import REGISTRY

from services.gateway import admission as adm
from services.gateway.admission import Admission, SharedCounts, Work

_CONTEXT = multiprocessing.get_context("spawn")
_ONE = (1, 1, 0)
"""One request of one sequence and no prompt tokens, as a count row."""


def _outcomes(process: str) -> tuple[float, float]:
    name = "deepinfer:api_process_requests_total"
    get = REGISTRY.get_sample_value
    return get(name, {"process": process, "outcome": "admitted"}), get(name, {"process": process, "outcome": "refused"})


def test_one_process_admits_up_to_the_limit_and_counts_each_outcome():
    admission = Admission(Work(2, 100, 100), process=7)
    assert [admission.try_enter() for _ in range(3)] == [None, None, "requests"]
    admission.leave()
    assert admission.try_enter() is None and admission.in_flight() == 2
    assert _outcomes("7") == (3.0, 1.0)


def test_every_kind_of_work_has_its_limit():
    admission = Admission(Work(10, 16, 1000))
    assert admission.too_big(Work(1, 17, 5)) == "sequences" and admission.too_big(Work(1, 16, 1001)) == "prompt_tokens"
    assert admission.too_big(Work(1, 16, 1000)) is None
    assert admission.try_enter(Work(1, 12, 100)) is None
    assert admission.try_enter(Work(1, 8, 100)) == "sequences"  # 12 + 8 > 16
    assert admission.try_enter(Work(1, 4, 950)) == "prompt_tokens"
    assert admission.try_enter(Work(1, 4, 900)) is None
    assert (admission.in_flight("sequences"), admission.in_flight("prompt_tokens")) == (16, 1000)
    admission.leave(Work(1, 12, 100))
    assert admission.in_flight("sequences") == 4 and admission.try_enter(Work(1, 8, 50)) is None


def test_retry_after_follows_the_drain_rate(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: clock[0])
    admission = Admission(Work(100, 10, 10**6))
    assert admission.try_enter(Work(1, 10, 0)) is None
    assert admission.retry_after_s(Work(1, 4, 0), "sequences") == adm._RETRY_UNKNOWN_S  # nothing drained yet
    for _ in range(10):  # one sequence finishes and another starts every second
        clock[0] += 1.0
        admission.leave(Work(1, 1, 0))
        assert admission.try_enter(Work(1, 1, 0)) is None
    # full, draining 1/s: 4 more need 4 s; 1000 more would need far longer than the cap
    assert admission.retry_after_s(Work(1, 4, 0), "sequences") == 4
    assert admission.retry_after_s(Work(1, 1000, 0), "sequences") == adm._RETRY_MAX_S
    assert admission.drain_time_s(Work(1, 3, 0)) == 3  # the engines had no room: 3 sequences to drain


def _enter_many(path: str, index: int, limit: int, tries: int, ready) -> None:
    counts = SharedCounts(path, index)
    ready.wait()  # both start together, so their updates interleave
    for _ in range(tries):
        counts.add_if_fits(_ONE, (limit, limit, limit))


def test_the_limit_holds_on_the_sum_of_every_process(tmp_path):
    path = str(tmp_path / "counts")
    SharedCounts.create(path, 3)
    ready = _CONTEXT.Event()
    procs = [_CONTEXT.Process(target=_enter_many, args=(path, i, 500, 300, ready)) for i in (1, 2)]
    for p in procs:
        p.start()
    ready.set()
    for p in procs:
        p.join(60)
    counts = SharedCounts(path, 0)
    assert [p.exitcode for p in procs] == [0, 0]
    assert counts.totals()[:2] == [500, 500] and counts.add_if_fits(_ONE, (500, 500, 500)) == 0
    assert counts.of(1) >= 200 and counts.of(2) >= 200  # 600 tries for 500 places: each got some
    counts.reset(1)  # process 1 died: its requests went with it
    assert counts.totals()[0] == counts.of(2) and counts.add_if_fits(_ONE, (500, 500, 500)) is None
    counts.remove(_ONE)
    assert counts.totals()[3:5] == [1, 1]  # finished work counts for the drain rate
    counts.close()


def _hold_the_lock(path: str, held) -> None:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as if killed in the middle of an update
    held.set()
    time.sleep(600)


def test_a_process_killed_while_holding_the_lock_wedges_nobody(tmp_path):
    path = str(tmp_path / "counts")
    SharedCounts.create(path, 2)
    held = _CONTEXT.Event()
    holder = _CONTEXT.Process(target=_hold_the_lock, args=(path, held))
    holder.start()
    assert held.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    counts = SharedCounts(path, 0)
    started = time.monotonic()
    assert counts.add_if_fits(_ONE, (1, 1, 1)) is None and time.monotonic() - started < 5
    counts.close()
