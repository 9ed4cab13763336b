"""The speculative slot pool: one slot per decoding sequence (`max_num_seqs` of them), holding its
drafts for the next step, and the engine's acceptance counters.

Built only where the role drafts (NORMAL, COMPLETION; SPEC §1's "MTP / speculative slot pool" row).
A sequence takes a slot at its first draft and gives it back whenever its blocks are freed
(`Scheduler.free_seq`: finish, abort, preemption), so drafts never outlive their KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.sequence import Sequence


@dataclass
class DraftSlot:
    tokens: list[int] = field(default_factory=list)
    """Draft tokens for the positions right after the sequence's last token (at most nextn)."""
    probs: Optional[torch.Tensor] = None
    """[len(tokens), V] fp32: the distributions the drafts were sampled from (None: greedy drafts)."""


@dataclass
class SpecStats:
    """Counters since start: drafts proposed to the target, drafts it accepted, both per position."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # [nextn]: drafts verified at position j
    accepted_at: list[int] = field(default_factory=list)  # [nextn]: of which accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for j in range(proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += int(j < accepted)


class DraftSlots:
    def __init__(self, num_slots: int, nextn: int):
        self.num_slots = num_slots
        self.nextn = nextn
        self._slots = [DraftSlot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = SpecStats(proposed_at=[0] * nextn, accepted_at=[0] * nextn)

    def get(self, seq: Sequence) -> Optional[DraftSlot]:
        return self._slots[seq.spec_slot] if seq.spec_slot >= 0 else None

    def assign(self, seq: Sequence) -> Optional[DraftSlot]:
        """The sequence's slot, taking a free one if it has none; None when the pool is exhausted."""
        if seq.spec_slot < 0:
            if not self._free:
                return None
            seq.spec_slot = self._free.pop()
        return self._slots[seq.spec_slot]

    def free(self, seq: Sequence) -> None:
        if seq.spec_slot >= 0:
            self._slots[seq.spec_slot] = DraftSlot()
            self._free.append(seq.spec_slot)
            seq.spec_slot = -1

    @property
    def num_free(self) -> int:
        return len(self._free)
