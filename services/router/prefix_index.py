"""The router's view of which prompt prefixes each worker holds, for prefix-aware routing.

The router sends every prompt, so it can remember what it sent where: a prompt is cut into chunks
of `CHUNK_TOKENS` tokens, each chunk named by a chain hash (the chunk's tokens and the hash before
it, so equal hashes mean equal prefixes), and each worker keeps the hashes of the prompts it
prefilled, least recently used first out. It is an estimate — an engine evicts on its own, and
caches whole blocks of its own size — that only steers the choice: the engine's own prefix cache
and store decide what is really reused, so a wrong guess costs time, never correctness.
Prompts with images are not indexed (their KV depends on the images, not only the tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CHUNK_TOKENS = 16
"""Granularity of the index: the smallest KV block size the engines use."""
MIN_CAPACITY = 4096
"""Chunks remembered per worker at least (a worker's KV cache plus host tier usually holds more)."""


def chunk_hashes(prompt: Sequence[int], chunk: int = CHUNK_TOKENS) -> list[int]:
    """The chain hash of every full chunk of `prompt`, in order."""
    hashes, h = [], 0
    for start in range(0, len(prompt) - chunk + 1, chunk):
        h = hash((h, tuple(prompt[start : start + chunk])))
        hashes.append(h)
    return hashes


class PrefixSet:
    """One worker's remembered chunks (a bounded LRU set)."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        self.capacity = max(1, capacity)
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def matched_tokens(self, hashes: Sequence[int], chunk: int = CHUNK_TOKENS) -> int:
        """Tokens of the longest remembered prefix (a read: recency unchanged)."""
        n = 0
        for h in hashes:
            if h not in self._chunks:
                break
            n += 1
        return n * chunk

    def record(self, hashes: Sequence[int]) -> None:
        """The worker now holds these chunks: the most recently used, their prefix before them."""
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)


def capacity_for(num_blocks: int, block_size: int) -> int:
    """Chunks to remember for a worker of this KV cache: twice what its cache holds (its host tier
    and the store keep more), at least `MIN_CAPACITY`."""
    return max(MIN_CAPACITY, 2 * num_blocks * block_size // CHUNK_TOKENS)
