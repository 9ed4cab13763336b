"""What the scheduler hands the engine for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_core.sequence import Sequence


@dataclass
class SchedulerOutputs:
    prompt_run: bool
    """A prefill step (True) or a decode step (False). An empty prefill step is legal."""
    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each scheduled sequence feeds this step (seq i -> its query length)."""
    finished_seqs: list[Sequence] = field(default_factory=list)
    """Sequences that ended since the last step: their blocks are released in this step."""
    ignored_seqs: list[Sequence] = field(default_factory=list)
    """Sequences refused this step (e.g. prompt over the limit); already finished."""
    preempted_seqs: list[Sequence] = field(default_factory=list)
    """Sequences stopped this step because KV ran out (stop_preempted_request); already finished."""
    clone_blocks: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV block copies the worker does before the forward (forked sequences)."""
    clone_states: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) state-slot copies before the forward (forked sequences)."""
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_seqs

    def samples(self, i: int) -> bool:
        """Whether scheduled seq i produces a token this step (its last uncomputed token is fed)."""
        seq = self.scheduled_seqs[i]
        return seq.num_cached_tokens + self.num_new_tokens[i] == len(seq)
