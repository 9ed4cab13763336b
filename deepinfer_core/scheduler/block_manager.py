"""Paged KV blocks: allocation with reference counts, and prefix caching.

A full block is identified by the chain hash of its tokens and its parent block's
hash, so equal hashes mean equal prefixes. A block whose last owner leaves keeps its
content and hash in an LRU pool: a later request with the same prefix takes it back
(a prefix hit); allocation evicts from the LRU end only when no never-used block is left.
Hashes are stable across processes (blake2b of the token bytes), so a KV store or
another engine can use the same keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Optional

from deepinfer_core.sequence import Sequence


def block_hash(parent: Optional[int], tokens: Seq[int]) -> int:
    """Chain hash of one full block of tokens."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little", signed=True)


def chain_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[int]:
    """Chain hashes of `seq`'s first `num_blocks` full blocks; those it has committed are reused.
    Equal on every engine for equal tokens and images (a KV store's keys start here)."""
    hashes = list(seq.block_hashes[:num_blocks])
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, seq.hash_slice(i * block_size, (i + 1) * block_size))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-used or hash-less, pop() = lowest id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but content cached; LRU first
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- single blocks ----------------------------------------------------------------
    def allocate_block(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_to_hash.pop(block)]
        else:
            raise RuntimeError("out of KV blocks: call can_allocate() first")
        self.ref_counts[block] = 1
        return block

    def _take_cached(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def release_block(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"double free of KV block {block}")
        self.ref_counts[block] = count - 1
        if count == 1:
            if block in self._block_to_hash:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- prefix cache ---------------------------------------------------------------
    def num_prompt_blocks(self, seq: Sequence) -> int:
        """Full blocks before the last token (which always needs computing): what a prefix can cover."""
        return (len(seq) - 1) // self.block_size

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks before the last token."""
        return chain_hashes(seq, self.block_size, self.num_prompt_blocks(seq))

    def _cached_prefix(self, hashes: list[int]) -> list[int]:
        blocks = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def count_cached_prefix(self, seq: Sequence) -> int:
        """Full blocks of `seq`'s prompt the prefix cache holds now (a read: nothing taken or counted)."""
        return len(self._cached_prefix(self._prompt_hashes(seq))) if self.enable_prefix_caching else 0

    # ---- sequences ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        """Blocks for all of `seq`'s tokens fit, counting prefix hits as free."""
        hits = self._cached_prefix(self._prompt_hashes(seq)) if self.enable_prefix_caching else []
        reused_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        need = self.blocks_needed(len(seq)) - len(hits)
        return need <= self.num_free_blocks - reused_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing its longest cached prefix."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        hashes = self._prompt_hashes(seq) if self.enable_prefix_caching else []
        hits = self._cached_prefix(hashes)
        for block in hits:
            self._take_cached(block)
        seq.block_table = list(hits)
        seq.block_hashes = hashes[: len(hits)]
        seq.num_cached_tokens = seq.num_prefix_hit_tokens = len(hits) * self.block_size
        seq.block_table += [self.allocate_block() for _ in range(self.blocks_needed(len(seq)) - len(hits))]
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_prefix_hit_tokens

    def adopt_blocks(self, seq: Sequence, blocks: list[int]) -> None:
        """`seq` becomes one more owner of existing blocks (forks share their parent's)."""
        self.hold(blocks)
        seq.block_table = list(blocks)

    def hold(self, blocks: list[int]) -> None:
        """One more owner of allocated blocks (`release_block` each to let go): a fork, or a copy
        still reading them (a KV store's save)."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"cannot share KV block {block}: it is not allocated")
            self.ref_counts[block] += 1

    def can_append_slot(self, seq: Sequence, num_tokens: int = 1) -> bool:
        need = self.blocks_needed(len(seq) + num_tokens - 1) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int = 1) -> None:
        """Ensure blocks for the next `num_tokens` token positions (decode)."""
        need = self.blocks_needed(len(seq) + num_tokens - 1) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self.allocate_block())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish hashes of blocks that became full of computed KV (prompt or output)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_cached_tokens // self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, seq.hash_slice(i * self.block_size, (i + 1) * self.block_size))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self._hash_to_block and block not in self._block_to_hash:
                self._hash_to_block[h] = block
                self._block_to_hash[block] = h

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s ownership of its blocks (reverse order: tails are evicted first)."""
        for block in reversed(seq.block_table):
            self.release_block(block)
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        for block in list(self._evictable):
            del self._hash_to_block[self._block_to_hash.pop(block)]
            self._free.append(block)
        self._evictable.clear()
