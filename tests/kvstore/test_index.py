"""L3's index: reservations under one byte limit, LRU eviction, stale reservations, and several
processes on one directory never exceeding the limit."""

import multiprocessing as mp
import os
import time

from deepinfer_core.kvstore.index import StoreIndex
from tests.helpers.kv_store import directory_bytes

SIZE = 1000


def _index(directory, capacity=5 * SIZE, **kw) -> StoreIndex:
    def path_of(key: bytes) -> str:
        return os.path.join(str(directory), key.hex() + ".kvblock")

    return StoreIndex(str(directory), capacity, path_of, **kw)


def _write(index: StoreIndex, keys: list[bytes]) -> list[bytes]:
    """Reserve, write and publish entries as the store does; returns the keys published."""
    reserved = index.reserve(keys, SIZE).keys
    for key in reserved:
        with open(index.path_of(key) + ".tmp", "wb") as f:
            f.write(bytes(SIZE))
    return index.publish(reserved, lambda k: index.path_of(k) + ".tmp")


def test_reserve_publish_and_lookup(tmp_path):
    index = _index(tmp_path)
    assert _write(index, [b"a", b"b"]) == [b"a", b"b"]
    assert index.count_prefix([b"a", b"b", b"c"]) == 2 and index.count_prefix([b"b", b"x", b"a"]) == 1
    again = index.reserve([b"a", b"c"], SIZE)
    assert again.keys == [b"c"] and again.stored == 1  # stored keys are not written twice
    assert index.count_prefix([b"c"]) == 0  # reserved, not ready: not served
    assert index.total_bytes() == 3 * SIZE


def test_least_recently_used_entries_are_evicted_and_the_limit_holds(tmp_path):
    index = _index(tmp_path)
    _write(index, [bytes([i]) for i in range(5)])
    time.sleep(0.01)
    index.touch([bytes([0])])  # 0 is now the most recently used
    out = index.reserve([b"x", b"y"], SIZE)
    assert out.evicted == 2 and out.keys == [b"x", b"y"]
    assert index.count_prefix([bytes([0])]) == 1
    assert not os.path.exists(index.path_of(bytes([1]))) and not os.path.exists(index.path_of(bytes([2])))
    assert index.total_bytes() == 5 * SIZE


def test_what_does_not_fit_beside_reservations_in_flight_is_left_out(tmp_path):
    index = _index(tmp_path, capacity=3 * SIZE)
    first = index.reserve([b"a", b"b"], SIZE)
    second = index.reserve([b"c", b"d"], SIZE)  # a and b are being written: they cannot be evicted
    assert first.keys == [b"a", b"b"] and second.keys == [b"c"]


def test_a_dead_writers_reservation_is_reclaimed_once_stale(tmp_path):
    index = _index(tmp_path, capacity=2 * SIZE, stale_s=0.05)
    index.reserve([b"a", b"b"], SIZE)  # never published: its writer died
    time.sleep(0.1)
    assert index.reserve([b"c"], SIZE).keys == [b"c"]


def test_remove_frees_bytes_and_files(tmp_path):
    index = _index(tmp_path)
    _write(index, [b"a"])
    index.remove([b"a"], [index.path_of(b"a")])
    assert index.total_bytes() == 0 and not os.path.exists(index.path_of(b"a"))


def _hammer(directory, worker: int, rounds: int) -> None:
    index = _index(directory)
    for r in range(rounds):
        _write(index, [f"{worker}-{r}-{i}".encode() for i in range(3)])


def test_processes_sharing_a_directory_never_exceed_the_limit(tmp_path):
    ctx = mp.get_context("spawn")
    _index(tmp_path)  # the schema, once
    workers = [ctx.Process(target=_hammer, args=(tmp_path, w, 30)) for w in range(3)]
    for w in workers:
        w.start()
    peak = 0
    while any(w.is_alive() for w in workers):
        peak = max(peak, directory_bytes(tmp_path))
        time.sleep(0.002)
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    index = _index(tmp_path)
    assert peak <= 5 * SIZE and directory_bytes(tmp_path) == index.total_bytes() <= 5 * SIZE


def _open_at_once(directory, barrier, errors) -> None:
    barrier.wait()
    try:
        _index(directory)
    except Exception as e:  # reported to the parent, which fails the test
        errors.put(repr(e))


def test_many_processes_opening_a_new_directory_at_once_all_succeed(tmp_path):
    """The ranks of an instance start together on one fresh directory: each must open it (the
    switch to WAL is contended then, and SQLite refuses it at once rather than waiting)."""
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    for attempt in range(20):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        barrier = ctx.Barrier(10)
        procs = [ctx.Process(target=_open_at_once, args=(directory, barrier, errors)) for _ in range(10)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
