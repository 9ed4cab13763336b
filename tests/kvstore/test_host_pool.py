"""L2's pool: LRU over unpinned entries only, pins that always come back, staging that never evicts a pin."""

import pytest

from deepinfer_core.kvstore.host_pool import HostPool

SLOT = 256  # 128-byte header + 100-byte payload, rounded up to the header's alignment


def _pool(slots: int = 4) -> HostPool:
    return HostPool(slots * SLOT, 100)


def test_capacity_is_whole_slots_and_too_small_is_refused():
    assert _pool(4).num_slots == 4 and _pool(4).slot_bytes == SLOT
    with pytest.raises(ValueError, match="l2_bytes"):
        HostPool(10, 100)


def test_staging_evicts_least_recently_used_unpinned_entries():
    pool = _pool(3)
    slots = pool.stage(3)
    for key, slot in zip([b"a", b"b", b"c"], slots):
        assert pool.publish(key, slot)
    pool.unpin(slots)
    pool.unpin([pool.take(b"a")])  # a is now the most recently used
    held = pool.take(b"b")  # b is pinned
    (staged,) = pool.stage(1)
    assert b"c" not in pool and b"a" in pool and b"b" in pool and pool.evictions == 1
    slot_a = pool.take(b"a")
    pool.unpin([slot_a])
    assert pool.stage(1) == [slot_a] and b"a" not in pool  # b stays: pinned
    assert pool.stage(1) == []  # nothing left that is free or unpinned
    pool.unpin([held, staged, slot_a])
    assert pool.num_pins == 0


def test_pins_return_to_zero_and_free_slots_come_back():
    pool = _pool(2)
    slots = pool.stage(2)
    assert pool.num_pins == 2 and pool.publish(b"x", slots[0])
    assert not pool.publish(b"x", slots[1])  # a key is held once
    pool.unpin(slots)
    assert pool.num_pins == 0 and len(pool._free) == 1
    pool.drop(b"x")
    assert len(pool._free) == 2 and pool.used_bytes == 0
    with pytest.raises(RuntimeError, match="unpinned"):
        pool.unpin([0])


def test_count_prefix_stops_at_the_first_missing_key():
    pool = _pool(3)
    for key, slot in zip([b"a", b"c"], pool.stage(2)):
        pool.publish(key, slot)
    assert pool.count_prefix([b"a", b"b", b"c"]) == 1
