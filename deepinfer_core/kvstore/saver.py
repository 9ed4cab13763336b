"""CE side: which blocks `do_save_kvcache` hands to the store.

Called once per decode step, after the step is launched and (SPEC invariant 6) after the state
copy is complete, before the finished sequences' blocks are freed:
- a finished sequence hands over every full block of computed KV it has not handed over yet;
- with `save_every_blocks = K > 0`, a running one does so each time K new full blocks have filled
  (a long generation is saved as it goes, not only at its end).

A block counts once its KV is computed (`num_cached_tokens`), so a block still being written by a
step in flight, or holding an output token not read back yet, is never saved. The store copies
the blocks to host memory before this returns on CPU; on a GPU its copy runs beside the next
steps and the blocks stay held in the block manager until it has run (`KVStore.save`): either
way no block is read after the scheduler may give it to another sequence. A sequence whose prompt holds image placeholders but that never
learnt its images' content hashes (from the hand-off notice) is not saved: its keys would not
tell two images apart.
"""

from __future__ import annotations

import logging
from typing import Optional

from deepinfer_core.kvstore.store import KVStore
from deepinfer_core.sequence import Sequence

logger = logging.getLogger(__name__)


class StoreSaver:
    def __init__(self, store: KVStore, block_size: int, every_blocks: int, image_token_id: Optional[int] = None):
        self.store = store
        self.block_size = block_size
        self.every_blocks = every_blocks
        self.image_token_id = image_token_id
        self._handed: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (running seq, full blocks handed over)

    def on_step(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        for seq in finished:
            self._save(seq, self._handed.pop(seq.seq_id, (seq, 0))[1])
        if not self.every_blocks:
            return
        for seq in scheduled:
            done = self._handed.get(seq.seq_id, (seq, 0))[1]
            if seq.num_cached_tokens // self.block_size - done >= self.every_blocks and not seq.is_finished:
                self._handed[seq.seq_id] = (seq, self._save(seq, done))
        for seq_id in [i for i, (s, _) in self._handed.items() if s.is_finished]:  # ended elsewhere (preempted)
            del self._handed[seq_id]

    def _save(self, seq: Sequence, done: int) -> int:
        """Hand over `seq`'s full blocks from `done` on; returns the full blocks handed over in all."""
        full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        if full <= done or not self._keys_are_sound(seq):
            return done
        keys = self.store.keys(seq, full)
        try:
            self.store.save(keys[done:], seq.block_table[done:full])
        except Exception as e:  # the index unreadable (disk error, lock timeout): the blocks go unsaved
            logger.warning("KV store save of %d blocks failed: %s", full - done, e)
            self.store.counters.save_dropped_blocks += full - done
        return full

    def _keys_are_sound(self, seq: Sequence) -> bool:
        return (
            bool(seq.mm_placeholders) or self.image_token_id is None or self.image_token_id not in seq.prompt_token_ids
        )

    @property
    def num_tracked(self) -> int:
        return len(self._handed)
