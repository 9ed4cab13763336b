"""PE side: at admission, load the longest stored prefix past the engine's own prefix cache.

The scheduler calls `start(seq)` right after giving a new sequence its blocks (L1 hits included):
- no stored block past the L1 hits: the sequence is scheduled as usual (False);
- every stored block in L2: copied into its blocks at once, then scheduled as usual (False);
- some in L3: the sequence waits in the scheduler's `loading` list (True) while the I/O thread reads
  and verifies them; `poll()` hands it back with its KV in place, or what was placed of it.

Only whole verified blocks are placed, in order from the L1 hits on: `num_cached_tokens` (and
`num_prefix_hit_tokens`, which reports every token not computed) moves to the end of the last one,
and the prefill computes the rest. A load that fails, fails a check, or ends later than
`KVStoreConfig.load_timeout_s` after it started places nothing from L3: those blocks are
recomputed. The loaded blocks become ordinary blocks of the sequence (and, once computed, of the
prefix cache); the hand-off to the CE sends them like the rest.
"""

from __future__ import annotations

import logging
import time

from deepinfer_core.kvstore.store import KVStore, StoreLoad
from deepinfer_core.sequence import Sequence

logger = logging.getLogger(__name__)


class StoreLoader:
    def __init__(self, store: KVStore, block_size: int, timeout_s: float, join_wait_s: float = 0.0):
        self.store = store
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.join_wait_s = join_wait_s
        """How long the scheduler waits for loads it has just started (`KVStoreConfig.join_wait_s`)."""
        self._loading: dict[int, tuple[Sequence, StoreLoad, int]] = {}  # seq_id -> (seq, load, first block)

    def start(self, seq: Sequence) -> bool:
        """Look up and start loading `seq`'s stored prefix; True when the sequence must wait for it."""
        if seq.params.prompt_logprobs is not None:  # its prompt logprobs need every position computed
            return False
        first = seq.num_cached_tokens // self.block_size
        num_blocks = (len(seq) - 1) // self.block_size
        self.store.counters.lookups += 1
        tiers = []
        if num_blocks > first:
            keys = self.store.keys(seq, num_blocks)[first:]
            try:
                tiers = self.store.lookup(keys)
            except Exception as e:  # the index unreadable (disk error, lock timeout): compute instead
                logger.warning("KV store lookup failed, computing the prompt: %s", e)
                self.store.counters.load_failures += 1
        if not tiers:
            self.store.counters.miss_tokens += len(seq) - seq.num_cached_tokens
            return False
        load = self.store.start_load(keys[: len(tiers)], tiers)
        if load.done:
            self._place(seq, load, first, use_l3=True)
            return False
        self._loading[seq.seq_id] = (seq, load, first)
        return True

    def poll(self, wait_s: float = 0.0) -> list[Sequence]:
        """Sequences whose load has ended (placed, dropped or late), in the order they started;
        waits up to `wait_s` for every load to end."""
        if not self._loading:
            return []
        deadline = time.monotonic() + wait_s
        self.store.poll()
        while any(not load.done for _, load, _ in self._loading.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.store.poll(wait_s=left)
        ready = []
        for seq_id, (seq, load, first) in list(self._loading.items()):
            late = load.seconds > self.timeout_s
            if load.done or late:
                if late:
                    self.store.counters.load_timeouts += 1
                del self._loading[seq_id]
                self._place(seq, load, first, use_l3=not late)
                ready.append(seq)
        return ready

    def cancel(self, seq: Sequence) -> None:
        """The sequence is aborted while it loads: its blocks may be freed now (reads land in pool
        slots, never in the KV cache); the slots come back when the read ends."""
        entry = self._loading.pop(seq.seq_id, None)
        if entry is not None:
            self.store.release_load(entry[1])

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def _place(self, seq: Sequence, load: StoreLoad, first: int, use_l3: bool) -> None:
        blocks = seq.block_table[first : first + len(load.keys)]
        placed = self.store.finish_load(load, blocks, use_l3)
        seq.num_cached_tokens = seq.num_prefix_hit_tokens = (first + placed) * self.block_size
        self.store.counters.miss_tokens += len(seq) - seq.num_cached_tokens
