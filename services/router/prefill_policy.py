"""Which prefill engine takes a prompt: its length bucket first, then the least queued tokens.

Prefill latency grows fast with prompt length, so short prompts should not queue behind long
ones. With at least as many PEs as buckets, PE i (in id order) serves bucket i % buckets; with
fewer, every PE serves every bucket. Within the bucket the PE with the fewest queued prompt
tokens (its last report plus what the router sent since) wins.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

DEFAULT_BUCKETS = (512, 2048)
"""Upper bounds (exclusive) of the prompt-length buckets; the last bucket is open-ended."""


@dataclass
class PrefillCandidate:
    worker_id: str
    queued_tokens: int
    """Prompt tokens waiting on the PE, including prefills the router has in flight there."""


class PrefillPolicy:
    def __init__(self, bucket_bounds: Sequence[int] = DEFAULT_BUCKETS):
        self.bounds = sorted(bucket_bounds)

    def bucket(self, prompt_len: int) -> int:
        return bisect.bisect_right(self.bounds, prompt_len - 1) if self.bounds else 0

    def pick(self, prompt_len: int, candidates: Sequence[PrefillCandidate]) -> Optional[str]:
        """The chosen worker id, or None when there is no candidate."""
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        if not ordered:
            return None
        num_buckets = len(self.bounds) + 1
        if len(ordered) >= num_buckets:
            b = self.bucket(prompt_len)
            ordered = [c for i, c in enumerate(ordered) if i % num_buckets == b]
        return min(ordered, key=lambda c: (c.queued_tokens, c.worker_id)).worker_id
