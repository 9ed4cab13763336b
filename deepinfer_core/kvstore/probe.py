"""How much of a prompt an engine would not compute: its prefix cache, then each store tier.

A router choosing among PEs asks each one (`PromptEngine.probe_prefix`), or reads L3 itself through
`StoreIndex.count_prefix` with keys from `keys.sequence_keys`. Reads only: nothing is pinned,
touched or counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deepinfer_core.kvstore.keys import placeholders_from_spans
from deepinfer_core.kvstore.store import L2, KVStore
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.block_manager import BlockManager
from deepinfer_core.sequence import Sequence


@dataclass(frozen=True)
class PrefixProbe:
    """Prompt tokens available from each tier, in order (L1 first, then L2 / L3 past it)."""

    l1_tokens: int = 0
    l2_tokens: int = 0
    l3_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


def probe_prefix(
    block_manager: BlockManager,
    store: Optional[KVStore],
    prompt_token_ids: list[int],
    image_spans: Optional[list[tuple[int, int, int]]] = None,
) -> PrefixProbe:
    """`image_spans`: (offset, length, content hash) of the prompt's images, placeholders expanded."""
    seq = Sequence(-1, "", list(prompt_token_ids), SamplingParams())
    seq.mm_placeholders = placeholders_from_spans(image_spans or [])
    bs = block_manager.block_size
    l1 = block_manager.count_cached_prefix(seq)
    num_blocks = block_manager.num_prompt_blocks(seq)
    if store is None or num_blocks <= l1:
        return PrefixProbe(l1 * bs)
    tiers = store.lookup(store.keys(seq, num_blocks)[l1:])
    l2 = sum(1 for t in tiers if t == L2)
    return PrefixProbe(l1 * bs, l2 * bs, (len(tiers) - l2) * bs)
