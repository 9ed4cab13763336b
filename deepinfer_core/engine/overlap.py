"""Zero-overhead scheduling (SPEC §1; env DEEPINFER_ZERO_OVERHEAD_SCHEDULING): the host work of
step C (schedule, input preparation, sampling rows) runs while the device still computes step P.

One `LLMEngine.step()` call, with step P in flight:

    advance(P)           P's sequences move on without P's tokens: num_cached_tokens, prefix-cache
                         commit, and a PLACEHOLDER as the last token of each sequence that sampled
    schedule(C)          lengths include the placeholders, so blocks are allocated as usual
    launch(C)            forward + sampling queued; a placeholder's input token is copied from P's
                         sampled-token tensor on the device (stream order: no host wait)
    pre_sampler_sync(C)  SPEC §2's hooks of C
    result(P)            P's sample-end sync, the call's only wait for the device ...
    post_process(P)      ... P's tokens replace the placeholders; detokenize, stop checks, outputs
    -> C is in flight; the call returns P's outputs

So outputs come one beat later than without overlap (the first call returns nothing), and a
sequence that P ends (EOS, stop token or string) was already scheduled in C: its C sample is
dropped, never appended or reported, and its blocks go back through the usual finished-sequence
path one step later. Ends known from counts alone (max_tokens, max_model_len) are retired at
advance instead, so they are neither scheduled in C nor hold their blocks longer.

Invariants: a placeholder is only ever a sequence's last token, past its computed KV, so a block
is never hashed for the prefix cache while it holds one; between two `step()` calls no sequence
holds a placeholder (P's are resolved in the call that made them). With nothing to schedule, a
call just finishes P.

What else stays as without overlap: an abort between calls drops the request's in-flight sample
(skipped at advance). A sequence preempted while its token is in flight keeps that token: for
recompute it re-enters `waiting` and the token is back before it can be scheduled again; when
preemption stops it, the token is still reported, and a token that ends it wins over the
preemption. Seeded sampling draws in launch order, which is step order. Prompt logprobs read
prompt tokens only. Blocks released while a launched step still writes them (finished, retired,
preempted) are only reused by steps launched later, on the same stream.

Overlap on a GPU needs a launch that never waits for the device: inputs go through
non-blocking copies (`worker.events.to_device`) and sampling is queued, not read back. A model
whose forward reads something back itself (the eager MoE path's per-expert counts) still waits
there for the step before it.

Fallbacks (P is read back before C is scheduled; that beat does not overlap, as in vLLM's async
scheduling and SGLang's overlap scheduler):
- a sequence of P has repetition/presence/frequency penalties: C's sampling reads the values of
  earlier outputs (min_tokens only needs their count, which is known);
- a sequence of P fans out (first sample of an n > 1 request): its forks are made from P's
  tokens and join C, as without overlap.
Steps of a PROMPT engine never overlap (its hand-off needs the step's own post-process).
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Optional

from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.sequence import Sequence
from deepinfer_core.worker.model_runner import PlaceholderFill, StepHandle

PLACEHOLDER = -1
"""Stands for a token the device has sampled but the host has not read yet (never a vocab id)."""


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    out: SchedulerOutputs
    handle: StepHandle
    num_rows: list[int]
    """Sampling rows per scheduled sequence: 0 (no sample), 1, or n (an n > 1 fan-out)."""
    live: set[int] = field(default_factory=set)
    """Batch indices advanced: the others had ended (or were aborted) before; their samples are dropped."""
    pending: dict[int, Sequence] = field(default_factory=dict)
    """Batch index -> sequence whose last token is this step's placeholder."""

    @classmethod
    def launched(cls, out: SchedulerOutputs, handle: StepHandle, rows: list[list[SamplingRow]]) -> InFlightStep:
        return cls(out, handle, [len(r) for r in rows])


def advance(step: InFlightStep, live_requests: Container[str], scheduler: Scheduler, max_model_len: int) -> bool:
    """Move an in-flight step's sequences on without its tokens (what `post_process` does before
    the samples): computed length, prefix-cache commit, and a placeholder per sample.
    Returns True when the next schedule must see the step's tokens (the fallbacks above)."""
    out = step.out
    for i, seq in enumerate(out.scheduled_seqs):
        if seq.request_id not in live_requests or seq.is_finished:
            continue  # aborted, or ended by the step before this one: this step's sample is dropped
        step.live.add(i)
        seq.num_cached_tokens += out.num_new_tokens[i]
        assert not has_placeholder(seq)  # so the committed blocks hold real tokens only
        scheduler.commit_computed(seq)
        if step.num_rows[i]:
            append_placeholder(seq)
            step.pending[i] = seq
    if must_resolve_before_schedule(step):
        return True
    for i, seq in step.pending.items():
        # Its sample ends it whatever the value: free its blocks and skip it from the next
        # schedule on, as the synchronous step would (a fan-out needs its blocks to fork).
        if step.num_rows[i] == 1 and seq in scheduler.running and ends_by_length(seq, max_model_len):
            scheduler.retire_seq(seq)
    return False


def append_placeholder(seq: Sequence) -> None:
    assert not has_placeholder(seq), f"sequence {seq.seq_id} already waits for a token"
    seq.output_token_ids.append(PLACEHOLDER)


def has_placeholder(seq: Sequence) -> bool:
    return bool(seq.output_token_ids) and seq.output_token_ids[-1] == PLACEHOLDER


def resolve_placeholder(seq: Sequence, token: int) -> None:
    """The token is back: it takes the placeholder's place (the sequence's length is unchanged)."""
    assert has_placeholder(seq), f"sequence {seq.seq_id} has no placeholder"
    seq.output_token_ids[-1] = token
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()


def needs_output_values(params: SamplingParams) -> bool:
    """Sampling reads the values of earlier output tokens (penalties), not just their count."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def must_resolve_before_schedule(step: InFlightStep) -> bool:
    """The next schedule needs this step's token values (see the fallbacks above)."""
    return any(step.num_rows[i] > 1 or needs_output_values(seq.params) for i, seq in step.pending.items())


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """With its placeholder appended, the sequence ends whatever the token is (check_stop's caps)."""
    num_output = len(seq.output_token_ids)
    return (seq.params.max_tokens is not None and num_output >= seq.params.max_tokens) or len(seq) >= max_model_len


def placeholder_fill(prev: Optional[InFlightStep], out: SchedulerOutputs) -> Optional[PlaceholderFill]:
    """Where `out`'s input tokens come from `prev`'s samples on the device; None when nowhere."""
    row_of = {id(seq): prev.handle.first_rows[i] for i, seq in prev.pending.items()} if prev is not None else {}
    rows = {}
    for i, seq in enumerate(out.scheduled_seqs):
        if id(seq) in row_of:
            rows[i] = row_of[id(seq)]
        else:
            assert not has_placeholder(seq), f"sequence {seq.seq_id} feeds a placeholder no running step fills"
    return PlaceholderFill(prev.handle.sampled_token_ids, rows) if rows else None
