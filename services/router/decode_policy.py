"""Which decode engine takes a request: fewest running requests and KV blocks, relative to size.

A decode step's cost grows with the batch (requests) and with the KV it reads, so the score adds
both, each as a fraction of the engine's capacity. Room is counted in whole KV blocks, as the
engine allocates them: a request may come to hold prompt + max output tokens, rounded up to its
block size, and an engine whose blocks the requests already on it may fill is skipped — counting
tokens instead lets many short requests, each wasting part of its last block, over-fill an engine
that then preempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that `tokens` tokens occupy."""
    return -(-tokens // max(1, block_size))


@dataclass
class DecodeCandidate:
    worker_id: str
    running: int
    """Requests the router has on the engine."""
    kv_blocks: int
    """Blocks those requests may come to hold (`blocks_for` prompt + max output, each)."""
    capacity_blocks: int
    """The engine's KV blocks."""
    max_running: int
    """The engine's max_num_seqs."""
    block_size: int = 1

    @property
    def score(self) -> float:
        return self.running / max(1, self.max_running) + self.kv_blocks / max(1, self.capacity_blocks)


class DecodePolicy:
    def pick(self, needed_tokens: int, candidates: Sequence[DecodeCandidate]) -> Optional[str]:
        """The chosen worker id, or None when none has the blocks for `needed_tokens` more tokens."""
        fits = [
            c
            for c in candidates
            if c.capacity_blocks - c.kv_blocks >= blocks_for(needed_tokens, c.block_size)
            and c.running < max(1, c.max_running)
        ]
        if not fits:
            return None
        return min(fits, key=lambda c: (c.score, c.running, c.worker_id)).worker_id
