"""A sequence: one generation stream (a request with n=1, or one of its n samples).

The token-budget model: `num_cached_tokens` (KV present in the cache) catches up with
`len(seq)` (all tokens). Prefill, chunked prefill, prefix hits, recompute after
preemption and decode are all cases of that one rule:
- tokens to compute this step = len - num_cached_tokens (or a chunk of them);
- a step that brings num_cached_tokens to len samples the next token;
- a sequence with num_cached_tokens == len - 1 is pure decode (the last token is
  the freshly sampled one, without KV yet) — this is the state a CE receives.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.errors import FinishReason
from deepinfer_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS, stop token or stop string
    FINISHED_LENGTH = 3  # max_tokens or max_model_len
    FINISHED_ABORTED = 4  # the client went away
    FINISHED_PREEMPTED = 5  # KV ran out and stop_preempted_request is set
    FINISHED_IGNORED = 6  # could never be scheduled (e.g. prompt over the limit)

    @property
    def is_finished(self) -> bool:
        return self.value >= SequenceStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        """OpenAI-style finish_reason (a str enum: it compares equal to "stop", "length", ...)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.FINISHED_PREEMPTED: FinishReason.PREEMPTED,
    SequenceStatus.FINISHED_IGNORED: FinishReason.ERROR,
}


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: Optional[int] = None
    index: int = 0
    """Which of the request's n samples this is."""

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Tokens whose KV is in this sequence's blocks."""
    num_prefix_hit_tokens: int = 0
    """Tokens found in the prefix cache at admission (not computed)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chain hashes of this sequence's full blocks, in order."""
    reserved_block_capacity: int = 0
    """Block-table capacity reserved at admission (NORMAL only; 0 = none)."""
    state_id: int = -1
    """Per-sequence state slot (recurrent / sliding-window state); -1 = none."""
    state_src: int = -1
    """For a fork: the parent's slot, cloned into this one when the fork starts decoding."""
    last_copy_state_token_idx: int = 0
    spec_slot: int = -1
    """Speculative slot (`spec_decode.slots.DraftSlots`) holding its drafts; -1 = none."""
    generator: Optional[torch.Generator] = None
    stop_reason: Optional[int | str] = None
    error: Optional[str] = None
    """Why the sequence ended early (preempted, ignored), for the client."""
    output_text: str = ""
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[Optional[dict[int, float]]] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    first_token_time: Optional[float] = None
    mm_placeholders: list = field(default_factory=list)
    """The prompt's images (`multimodal.inputs.ImagePlaceholder`: positions, embeddings, content hash)."""

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def hash_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) as prefix-cache keys: image positions stand for their image's content."""
        tokens = self.token_slice(start, end)
        for p in self.mm_placeholders:
            for pos in range(max(start, p.offset), min(end, p.offset + p.length)):
                tokens[pos - start] = p.hash_token(pos - p.offset)
        return tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_cached_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token lacks KV: this sequence needs a prefill pass."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def reset_for_recompute(self) -> None:
        """After preemption: forget the KV; prompt + outputs so far will be prefilled again."""
        self.block_table = []
        self.block_hashes = []
        self.num_cached_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.status = SequenceStatus.WAITING
