"""`KVStore`: one engine's view of the KV cache store, L2 (its host pool) over L3 (entry files, or
objects in a bucket: `FileTier` or `ObjectTier`, the same jobs and results).

Called on the engine's thread only; the file work runs on the store's I/O thread (`io_thread`).

- `lookup(keys)`: the tier of each block of the longest stored prefix of `keys` ("l2" or "l3"), one
  index query for the whole prompt.
- `start_load(keys, tiers)` / `finish_load(load, blocks)`: L2 blocks are pinned at once; L3 blocks
  are read into staged slots by the I/O thread and verified there; `finish_load` copies the
  verified prefix into the engine's KV blocks, promotes the L3 ones into L2 and unpins. A load is
  all in L2 (done at once) or has an I/O job (`done` once its result is back).
- `save(keys, blocks)`: copies the blocks into pool slots (on CPU before it returns; on a GPU on the
  store's stream, the blocks held in the engine's block manager until the copy has fired, so the
  scheduler cannot give them to another sequence while they are read), publishes them in L2 and
  queues the file write. Blocks already in L2 are written from their slot with no copy; blocks
  already in L3 are skipped.
- `poll()`: takes the I/O thread's results between steps (unpins, counters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from deepinfer_core.config import KVStoreConfig
from deepinfer_core.kvstore import block_copy
from deepinfer_core.kvstore.file_tier import FileTier, IOResult, LoadJob, SaveJob
from deepinfer_core.kvstore.host_pool import HostPool
from deepinfer_core.kvstore.io_thread import IOThread
from deepinfer_core.kvstore.keys import sequence_keys
from deepinfer_core.kvstore.stats import KVStoreStats
from deepinfer_core.sequence import Sequence
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.storage_io import open_file_io

if TYPE_CHECKING:
    from deepinfer_core.scheduler.block_manager import BlockManager

L2, L3 = "l2", "l3"


@dataclass
class StoreLoad:
    """One prompt's load of consecutive blocks."""

    keys: list[bytes]
    tiers: list[str]
    slots: list[int]
    """Per block: its L2 slot, or the slot staged for its L3 read (all pinned)."""
    job: Optional[LoadJob] = None
    """The L3 read (None: every block is in L2)."""
    result: Optional[IOResult] = None
    started: float = 0.0
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return self.job is None or self.result is not None

    @property
    def seconds(self) -> float:
        """Start to the end of its I/O (so far, while it runs)."""
        end = self.result.finished if self.result is not None else time.monotonic()
        return end - self.started


def open_tier(config: KVStoreConfig, pool: HostPool, namespace: bytes, name: str):
    """L3: objects in `config.url`'s bucket, else files under `config.directory`."""
    if config.url is not None:
        from deepinfer_core.kvstore.object_tier import ObjectTier  # lazy: boto3 only for a bucket

        return ObjectTier(config, pool, namespace, name)
    file_io = open_file_io(config.backend, name, pool.buffer)
    return FileTier(config.directory, config.l3_bytes, pool, namespace, file_io)


class KVStore:
    def __init__(
        self,
        config: KVStoreConfig,
        kv_buffer: torch.Tensor,
        layout: KVLayout,
        namespace: bytes,
        name: str,
        block_manager: Optional[BlockManager] = None,
    ):
        """`block_manager`: the engine's, to hold blocks a GPU save still reads (None: saves wait
        for their copy instead)."""
        self.config = config
        self.kv = kv_buffer
        self.block_size = layout.block_size
        self.namespace = namespace
        self.pool = HostPool(config.l2_bytes, layout.num_layers * layout.block_bytes, pin_memory=kv_buffer.is_cuda)
        self.tier = open_tier(config, self.pool, namespace, name)
        self.io = IOThread(self.tier, name)
        self.counters = KVStoreStats(l3_capacity_bytes=config.l3_bytes)
        self._jobs: dict[int, StoreLoad] = {}  # id(job) -> its load, until the result is back
        self._saves: dict[int, SaveJob] = {}
        self.block_manager = block_manager
        self._stream = torch.cuda.Stream(kv_buffer.device) if kv_buffer.is_cuda and block_manager else None
        self._held: list[tuple[object, list[int]]] = []  # (copy-done event, blocks held until it fires)

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        return sequence_keys(seq, self.block_size, self.namespace, num_blocks)

    # ---- lookups and loads ----------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tiers of the longest prefix of `keys` that L2 or L3 holds."""
        in_l2 = [k in self.pool for k in keys]
        on_disk = self.tier.ready_keys([k for k, held in zip(keys, in_l2) if not held])
        tiers = []
        for key, held in zip(keys, in_l2):
            if not held and key not in on_disk:
                break
            tiers.append(L2 if held else L3)
        return tiers

    def start_load(self, keys: list[bytes], tiers: list[str]) -> StoreLoad:
        """Pin the L2 blocks and queue the L3 reads; fewer blocks when the pool lacks staging room."""
        held = {i: self.pool.take(k) for i, (k, t) in enumerate(zip(keys, tiers)) if t == L2}  # before staging evicts
        l3 = [i for i, t in enumerate(tiers) if t == L3]
        staged = self.pool.stage(len(l3))
        cut = len(keys) if len(staged) == len(l3) else l3[len(staged)]  # up to the first L3 block without a slot
        self.pool.unpin([s for i, s in held.items() if i >= cut])
        keys, tiers, it = keys[:cut], tiers[:cut], iter(staged)
        slots = [held[i] if t == L2 else next(it) for i, t in enumerate(tiers)]
        load = StoreLoad(keys, tiers, slots, started=time.monotonic())
        reads = [(k, s) for k, t, s in zip(keys, tiers, slots) if t == L3]
        if reads:
            load.job = LoadJob([k for k, _ in reads], [s for _, s in reads], started=load.started)
            self._jobs[id(load.job)] = load
            self.io.submit(load.job)
        return load

    def finish_load(self, load: StoreLoad, blocks: list[int], use_l3: bool = True) -> int:
        """Copy the load's usable prefix into `blocks` (the engine's, in order) and release it;
        returns the number of blocks placed. `use_l3=False` (a late load): only its leading L2 blocks."""
        ok = load.result.ok if load.result is not None and use_l3 else 0
        usable, seen = 0, 0
        for tier in load.tiers:
            if tier == L3:
                if seen >= ok:
                    break
                seen += 1
            usable += 1
        if usable:
            block_copy.slots_to_blocks(self.pool, load.slots[:usable], self.kv, blocks[:usable])
        self._count_load(load, usable)
        self.release_load(load, promote=usable)
        return usable

    def release_load(self, load: StoreLoad, promote: int = 0) -> None:
        """Give back the load's slots: its first `promote` L3 blocks join L2; L3 slots whose read is
        still running are given back when it ends (`poll`)."""
        load.abandoned = True
        running = not load.done
        for i, (key, tier, slot) in enumerate(zip(load.keys, load.tiers, load.slots)):
            if tier == L3:
                if running:
                    continue
                if i < promote:
                    self.pool.publish(key, slot)
            self.pool.unpin([slot])

    def _count_load(self, load: StoreLoad, usable: int) -> None:
        c = self.counters
        l2 = sum(1 for t in load.tiers[:usable] if t == L2)
        c.hit_tokens_l2 += l2 * self.block_size
        c.hit_tokens_l3 += (usable - l2) * self.block_size
        c.load_bytes_l2 += l2 * self.pool.payload_bytes
        c.load_bytes_l3 += (usable - l2) * self.pool.frame_bytes
        if usable:
            c.loads += 1
            c.load_seconds += time.monotonic() - load.started

    # ---- saves ----------------------------------------------------------------------------
    def save(self, keys: list[bytes], blocks: list[int]) -> None:
        """Hand blocks (the engine's, holding the KV of `keys`) to the store; does not wait."""
        on_disk = self.tier.known_keys(keys)
        todo = [(k, b) for k, b in zip(keys, blocks) if k not in on_disk]
        self.counters.save_skipped_blocks += len(keys) - len(todo)
        held = [(k, self.pool.take(k)) for k, _ in todo if k in self.pool]
        fresh = [(k, b) for k, b in todo if k not in self.pool]
        slots = self.pool.stage(len(fresh))
        self.counters.save_dropped_blocks += len(fresh) - len(slots)
        fresh = fresh[: len(slots)]
        ready = None
        if fresh:
            ready = self._copy_out([b for _, b in fresh], slots)
            for (key, _), slot in zip(fresh, slots):
                self.pool.publish(key, slot)
        pairs = held + [(k, s) for (k, _), s in zip(fresh, slots)]
        if pairs:
            job = SaveJob([k for k, _ in pairs], [s for _, s in pairs], ready)
            self._saves[id(job)] = job
            self.io.submit(job)

    def _copy_out(self, blocks: list[int], slots: list[int]):
        """KV blocks into slots; on the store's stream the blocks are held until the copy fires."""
        if self._stream is None:
            ready = block_copy.blocks_to_slots(self.kv, blocks, self.pool, slots)
            if ready is not None:
                ready.synchronize()  # no block manager to hold the blocks: wait for the copy
            return None
        self.block_manager.hold(blocks)
        ready = block_copy.blocks_to_slots(self.kv, blocks, self.pool, slots, self._stream)
        self._held.append((ready, blocks))
        return ready

    def _release_copied(self) -> None:
        """Blocks whose save copy has fired go back to the engine."""
        still = []
        for event, blocks in self._held:
            if event.query():
                for block in blocks:
                    self.block_manager.release_block(block)
            else:
                still.append((event, blocks))
        self._held = still

    @property
    def num_held_blocks(self) -> int:
        return sum(len(blocks) for _, blocks in self._held)

    # ---- between steps --------------------------------------------------------------------
    def poll(self, wait_s: float = 0.0) -> None:
        """Take finished I/O: saves unpin their slots, loads get their result (`StoreLoad.done`);
        blocks held by GPU save copies that have fired are released."""
        if self._held:
            self._release_copied()
        for result in self.io.results(wait_s):
            c = self.counters
            c.corrupt_entries += result.corrupt
            c.evictions_l3 += result.evicted
            if result.total_bytes >= 0:
                c.l3_bytes = result.total_bytes
            if isinstance(result.job, SaveJob):
                self._saves.pop(id(result.job), None)
                c.saved_blocks += result.ok
                c.saved_bytes += result.ok * self.pool.frame_bytes
                c.save_skipped_blocks += result.skipped
                c.save_dropped_blocks += result.dropped
                self.pool.unpin(result.job.slots)
                continue
            load = self._jobs.pop(id(result.job))
            load.result = result
            if result.failed:
                c.load_failures += 1
            if load.abandoned:  # dropped while reading: its verified blocks still join L2
                self._release_late(load)

    def _release_late(self, load: StoreLoad) -> None:
        ok = load.result.ok
        for key, slot in zip(load.job.keys, load.job.slots):
            if ok > 0:
                self.pool.publish(key, slot)
                ok -= 1
            self.pool.unpin([slot])

    def stats(self) -> KVStoreStats:
        c = self.counters
        c.l2_bytes, c.l2_capacity_bytes = self.pool.used_bytes, self.pool.capacity_bytes
        c.evictions_l2 = self.pool.evictions
        c.l2_pins, c.held_blocks = self.pool.num_pins, self.num_held_blocks
        c.inflight_loads, c.inflight_saves = len(self._jobs), len(self._saves)
        return KVStoreStats(**{k: getattr(c, k) for k in c.__dataclass_fields__})

    def close(self) -> None:
        self.io.close()
        self.tier.close()
