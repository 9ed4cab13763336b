"""The store over a KV cache on a GPU: saves copy into pinned slots behind the stream (the engine goes
on), loads copy back into VRAM, and what a fresh store loads from the files is what was saved."""

import time

import pytest
import torch

from deepinfer_core.config import KVStoreConfig
from deepinfer_core.kvstore.store import L2, L3, KVStore
from deepinfer_core.transfer.layout import KVLayout
from tests.helpers.kv_store import settle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KEYS = [bytes([i]) * 16 for i in range(8)]


def _store(directory, kv: torch.Tensor) -> KVStore:
    layout = KVLayout.of({"architectures": ["Test"]}, kv, kv.shape[2])
    return KVStore(KVStoreConfig(directory=str(directory), l2_bytes=4 << 20), kv, layout, b"cuda-namespace-0", "t")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_then_load_through_files_on_a_gpu(tmp_path, dtype):
    kv = torch.randn((4, 40, 16, 72), device="cuda").to(dtype)
    original = kv[:, :8].clone()
    writer = _store(tmp_path, kv)
    assert writer.pool.buffer.is_pinned()
    writer.save(KEYS, list(range(8)))
    kv[:, :8].zero_()  # the engine reuses the blocks at once: the save copied them first, in stream order
    settle(writer)
    assert writer.stats().saved_blocks == 8
    reader = _store(tmp_path, torch.zeros_like(kv))
    tiers = reader.lookup(KEYS)
    assert tiers == [L3] * 8
    load = reader.start_load(KEYS, tiers)
    while not load.done:
        reader.poll(wait_s=0.01)
    assert reader.finish_load(load, list(range(20, 28))) == 8
    torch.testing.assert_close(reader.kv[:, 20:28], original, rtol=0, atol=0)
    assert reader.lookup(KEYS) == [L2] * 8 and reader.stats().l2_pins == 0


def test_a_save_holds_its_blocks_until_its_copy_has_run(tmp_path):
    from deepinfer_core.scheduler.block_manager import BlockManager

    kv = torch.randn((4, 41, 16, 72), device="cuda")
    original = kv[:, :8].clone()
    blocks = BlockManager(40, 16)
    owned = [blocks.allocate_block() for _ in range(8)]
    layout = KVLayout.of({"architectures": ["Test"]}, kv, 16)
    config = KVStoreConfig(directory=str(tmp_path), l2_bytes=4 << 20)
    store = KVStore(config, kv, layout, b"cuda-namespace-0", "t", block_manager=blocks)
    torch.cuda._sleep(50_000_000)  # a long step still running: the copy queues behind it
    store.save(KEYS, owned)
    for block in owned:  # the sequence ends; its blocks are not free while the copy reads them
        blocks.release_block(block)
    assert store.stats().held_blocks == 8 and blocks.num_free_blocks == 32
    settle(store)
    deadline = time.monotonic() + 30
    while store.stats().held_blocks:
        assert time.monotonic() < deadline
        store.poll(wait_s=0.01)
    assert blocks.num_free_blocks == 40 and all(c == 0 for c in blocks.ref_counts)
    slots = [store.pool.take(k) for k in KEYS]
    copied = torch.stack([store.pool.payload_rows[s].view(torch.float32).view(4, 16, 72) for s in slots], 1)
    torch.testing.assert_close(copied, original.cpu(), rtol=0, atol=0)
