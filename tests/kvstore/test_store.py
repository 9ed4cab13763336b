"""`KVStore` over a CPU tensor: saves reach the files, loads bring back the same bytes through L3 (NIXL's
POSIX backend, and plain file I/O) and L2, damage is caught, and the byte limit holds."""

import os

import pytest
import torch

from deepinfer_core.kvstore.store import L2, L3
from tests.helpers.kv_store import cpu_store, directory_bytes, entry_files, load_stored, settle

KEYS = [bytes([i]) * 16 for i in range(6)]


@pytest.fixture(params=["POSIX", "FILE"])
def backend(request):
    return request.param


def _saved(tmp_path, backend, **kw):
    writer = cpu_store(tmp_path, backend=backend, **kw)
    writer.save(KEYS, [1, 2, 3, 4, 5, 6])
    settle(writer)
    return writer


def test_a_fresh_store_loads_the_saved_blocks_from_files(tmp_path, backend):
    writer = _saved(tmp_path, backend)
    assert writer.tier.io.name == backend
    assert len(entry_files(tmp_path)) == 6 and writer.stats().saved_blocks == 6
    reader = cpu_store(tmp_path, backend=backend)
    tiers, placed = load_stored(reader, KEYS, [10, 11, 12, 13, 14, 15])
    assert tiers == [L3] * 6 and placed == 6
    assert torch.equal(reader.kv[:, 10:16], writer.kv[:, 1:7])
    assert reader.lookup(KEYS) == [L2] * 6  # promoted
    stats = reader.stats()
    assert stats.hit_tokens_l3 == 48 and stats.l2_pins == 0 and stats.inflight_loads == 0


def test_l2_hits_copy_from_host_memory_without_io(tmp_path):
    store = _saved(tmp_path, "POSIX")
    tiers, placed = load_stored(store, KEYS[:3], [20, 21, 22])
    assert tiers == [L2] * 3 and placed == 3 and torch.equal(store.kv[:, 20:23], store.kv[:, 1:4])
    assert store.stats().hit_tokens_l2 == 24 and store.stats().load_bytes_l3 == 0


def test_a_second_save_of_stored_blocks_writes_nothing(tmp_path):
    store = _saved(tmp_path, "POSIX")
    store.save(KEYS, [1, 2, 3, 4, 5, 6])
    settle(store)
    assert store.stats().saved_blocks == 6 and store.stats().save_skipped_blocks == 6


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "header"])
def test_a_damaged_entry_ends_the_load_there_and_leaves_the_store(tmp_path, backend, damage):
    writer = _saved(tmp_path, backend)
    path = writer.tier.path_of(KEYS[3])
    if damage == "flipped":
        _flip(path, os.path.getsize(path) - 5)
    elif damage == "header":
        _flip(path, 100)
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    reader = cpu_store(tmp_path, backend=backend)
    reader.kv.zero_()
    _, placed = load_stored(reader, KEYS, [10, 11, 12, 13, 14, 15])
    assert placed == 3 and torch.equal(reader.kv[:, 10:13], writer.kv[:, 1:4])
    assert not reader.kv[:, 13:16].any()  # nothing of the damaged entry or past it was placed
    assert reader.stats().corrupt_entries == 1 and not os.path.exists(path)
    assert reader.lookup(KEYS) == [L2] * 3  # the damaged one is gone from the index too


def test_an_entry_gone_since_the_lookup_is_a_failed_load(tmp_path):
    writer = _saved(tmp_path, "POSIX")
    reader = cpu_store(tmp_path)
    tiers = reader.lookup(KEYS)
    os.unlink(writer.tier.path_of(KEYS[1]))
    load = reader.start_load(KEYS, tiers)
    while not load.done:
        reader.poll(wait_s=0.01)
    assert reader.finish_load(load, list(range(10, 16))) == 1
    assert reader.stats().load_failures == 1 and reader.stats().l2_pins == 0


def test_the_directory_never_holds_more_than_its_limit(tmp_path):
    frame_bytes = cpu_store(tmp_path / "probe").pool.frame_bytes
    limit = 3 * frame_bytes + frame_bytes // 2  # room for 3 entries
    store = cpu_store(tmp_path / "store", l3_bytes=limit)
    for round_ in range(5):
        keys = [bytes([round_, i]) * 8 for i in range(2)]
        store.save(keys, [round_, round_ + 1])
        settle(store)
        assert directory_bytes(tmp_path / "store") <= limit
    stats = store.stats()
    assert len(entry_files(tmp_path / "store")) == 3 and stats.evictions_l3 == 7
    assert stats.l3_bytes == 3 * frame_bytes and stats.saved_blocks == 10


def test_a_pool_with_no_free_slot_drops_the_save_and_keeps_its_pins(tmp_path):
    slot_bytes = cpu_store(tmp_path / "probe").pool.slot_bytes
    store = cpu_store(tmp_path / "store", l2_bytes=3 * slot_bytes)
    store.save(KEYS, [1, 2, 3, 4, 5, 6])
    settle(store)
    stats = store.stats()
    assert stats.saved_blocks == 3 and stats.save_dropped_blocks == 3 and stats.l2_pins == 0
