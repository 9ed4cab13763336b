"""Speculative decoding in tests: an oracle drafter (right where told, wrong elsewhere) and a
fixture-friendly guard of the role environment an in-process engine sets."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from deepinfer_core import envs
from deepinfer_core.spec_decode.decoder import SpecDecoder


@contextlib.contextmanager
def role_environment() -> Iterator[None]:
    """Building an engine applies its role's env defaults (`EngineArgs`); later tests see their own."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for name in ("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "DEEPINFER_USE_MULTIMODAL_POOL"):
            envs.rearm(name)


def oracle_drafts(monkeypatch, reference: dict[str, list[int]], right: Callable[[int], bool], vocab: int) -> None:
    """Replace the MTP's greedy drafts: the draft of output index i is `reference[request][i]` when
    `right(i)`, else a different token. The MTP layer still runs (its KV is still written)."""
    original = SpecDecoder._take_drafts

    def take(self, seqs, slots, h):
        original(self, seqs, slots, h)
        for seq, slot in zip(seqs, slots):
            i = len(seq.output_token_ids) + len(slot.tokens) - 1  # output index of the draft just made
            ref = reference[seq.request_id]
            good = ref[i] if i < len(ref) else 0
            slot.tokens[-1] = good if right(i) else (good + 1) % vocab

    monkeypatch.setattr(SpecDecoder, "_take_drafts", take)
