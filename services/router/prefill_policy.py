"""Which prefill engine takes a prompt: the least work before it is done, among the PEs of its
length bucket and those that hold part of it already.

Prefill latency grows fast with prompt length, so short prompts should not queue behind long
ones. With at least as many PEs as buckets, PE i (in id order) serves bucket i % buckets; with
fewer, every PE serves every bucket. A PE that holds a prefix of the prompt (`prefix_index.py`)
is a candidate whatever its bucket. The score is the prompt tokens the PE would compute before
this prompt is done: its queued tokens (its last report plus what the router sent since) plus
this prompt's tokens it does not hold; the lowest wins, ties to the bucket's PE.
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
    cached_tokens: int = 0
    """Tokens of this prompt's prefix the PE is believed to hold (its prefix cache or host tier)."""

    def score(self, prompt_len: int) -> int:
        """Prompt tokens the PE computes before this prompt is done."""
        return self.queued_tokens + prompt_len - min(self.cached_tokens, prompt_len)


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
        in_bucket = ordered
        if len(ordered) >= num_buckets:
            b = self.bucket(prompt_len)
            in_bucket = [c for i, c in enumerate(ordered) if i % num_buckets == b]
        bucket_ids = {c.worker_id for c in in_bucket}
        holders = [c for c in ordered if c.cached_tokens > 0 and c.worker_id not in bucket_ids]
        chosen = min(
            in_bucket + holders, key=lambda c: (c.score(prompt_len), c.worker_id not in bucket_ids, c.worker_id)
        )
        return chosen.worker_id
