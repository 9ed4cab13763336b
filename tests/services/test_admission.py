"""Admission against `--max-concurrent-requests`: one process's count, and the count that every API
process of one server shares (`SharedCounts`), across real processes: the limit holds on the sum,
a dead process's count can be zeroed, and one killed while it holds the lock wedges nobody."""

import fcntl
import multiprocessing
import os
import signal
import time

from prometheus_client import REGISTRY

from services.gateway.admission import Admission, SharedCounts

_CONTEXT = multiprocessing.get_context("spawn")


def _outcomes(process: str) -> tuple[float, float]:
    name = "deepinfer:api_process_requests_total"
    get = REGISTRY.get_sample_value
    return get(name, {"process": process, "outcome": "admitted"}), get(name, {"process": process, "outcome": "refused"})


def test_one_process_admits_up_to_the_limit_and_counts_each_outcome():
    admission = Admission(2, process=7)
    assert [admission.try_enter() for _ in range(3)] == [True, True, False]
    admission.leave()
    assert admission.try_enter() and admission.in_flight == 2
    assert _outcomes("7") == (3.0, 1.0)


def _enter_many(path: str, index: int, limit: int, tries: int, ready) -> None:
    counts = SharedCounts(path, index)
    ready.wait()  # both start together, so their updates interleave
    for _ in range(tries):
        counts.add_if_below(limit)


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
    assert counts.total() == 500 and not counts.add_if_below(500)
    assert counts.of(1) >= 200 and counts.of(2) >= 200  # 600 tries for 500 places: each got some
    counts.reset(1)  # process 1 died: its requests went with it
    assert counts.total() == counts.of(2) and counts.add_if_below(500)
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
    assert counts.add_if_below(1) and time.monotonic() - started < 5
    counts.close()
