"""Which decode engine takes a request: fewest running requests and KV tokens, relative to size.

A decode step's cost grows with the batch (requests) and with the KV it reads (tokens), so the
score adds both, each as a fraction of the engine's capacity; an engine without the free KV
for the prompt is skipped (its Reserve would be refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass
class DecodeCandidate:
    worker_id: str
    running: int
    """Requests the router has on the engine."""
    kv_tokens: int
    """Tokens (prompt + output so far) of those requests."""
    capacity_tokens: int
    """KV blocks * block size."""
    max_running: int
    """The engine's max_num_seqs."""

    @property
    def score(self) -> float:
        return self.running / max(1, self.max_running) + self.kv_tokens / max(1, self.capacity_tokens)


class DecodePolicy:
    def pick(self, needed_tokens: int, candidates: Sequence[DecodeCandidate]) -> Optional[str]:
        """The chosen worker id, or None when none has room for `needed_tokens` more."""
        fits = [
            c
            for c in candidates
            if c.capacity_tokens - c.kv_tokens >= needed_tokens and c.running < max(1, c.max_running)
        ]
        if not fits:
            return None
        return min(fits, key=lambda c: (c.score, c.running, c.worker_id)).worker_id
