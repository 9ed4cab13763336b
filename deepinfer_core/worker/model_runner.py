"""Runs one step on the device: prepare inputs, forward, logits, sample.

The engine calls `launch()` (forward and sampling queued), runs its pre-sampler hooks,
then `StepHandle.result()` waits for the sampled tokens (SPEC §2's sample_end_event).
`launch()` never reads anything back from the device: the sampled tokens stay in a device
tensor (`StepHandle.sampled_token_ids`) that the next step can consume before anyone has
looked at them (zero-overhead scheduling), and `result()` is the only host sync.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from deepinfer_core.config import EngineConfig
from deepinfer_core.sampling.logprobs import QueuedLogprobs, queue_logprobs
from deepinfer_core.sampling.sampler import QueuedSample, Sampler, SamplerOutput
from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.worker.cache_engine import CacheEngine
from deepinfer_core.worker.events import to_device
from deepinfer_core.worker.input_batch import ModelInput, build_model_input, placeholder_input

if TYPE_CHECKING:
    from deepinfer_core.distributed.expert_parallel import ExpertParallel

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Sampled tokens of one step, per scheduled sequence (empty lists: no sample this step)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[Optional[dict[int, float]]]]
    prompt_logprobs: dict[int, list[Optional[dict[int, float]]]] = field(default_factory=dict)
    """batch index -> prompt-logprob entries for the positions this step covered."""
    consecutive: bool = False
    """A sequence's tokens follow one another (speculative decoding: accepted drafts, then the
    target's token), rather than being the n > 1 samples of a first token."""


@dataclass
class PlaceholderFill:
    """Input tokens of a step that the previous step samples: still on the device, never read back."""

    source: torch.Tensor
    """[R] int64: the previous step's `StepHandle.sampled_token_ids`."""
    rows: dict[int, int]
    """Batch index in this step -> row of `source`. The token is the last one that sequence feeds."""


class StepHandle:
    """A launched step; `result()` is the sample-end synchronisation point."""

    def __init__(
        self, finish, sampled_token_ids: Optional[torch.Tensor] = None, first_rows: Optional[dict[int, int]] = None
    ):
        self._finish = finish
        self._result: Optional[StepResult] = None
        self.sampled_token_ids = sampled_token_ids
        """[R] int64 on the device, one per sampling row (n > 1 fan-out: n rows); None if nothing samples."""
        self.first_rows = first_rows or {}
        """Batch index -> row of `sampled_token_ids` holding that sequence's (first) sample."""

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result


@dataclass
class _QueuedStep:
    """What `launch()` queued for sampling; `_read_back` turns it into a StepResult."""

    num_seqs: int
    counts: dict[int, int]  # batch index -> sampling rows, for the sequences that sample
    sample: Optional[QueuedSample] = None
    prompt_logprobs: dict[int, QueuedLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: nn.Module, device: torch.device, ep: Optional[ExpertParallel] = None
    ):
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.sampler = Sampler()
        self.cache: Optional[CacheEngine] = None
        self.ep = ep
        """Expert parallelism: every launch enters the MoE collectives, a step with no work too."""
        self.num_dummy_steps = 0
        """Steps with nothing scheduled that ran a dummy forward to keep the instance in lockstep."""
        # an expert-parallel decode step is capturable through the padded dispatch only: the exact
        # all-to-all reads its split sizes back to the host, so its ranks run decode eagerly
        self.use_cuda_graph = (
            not config.enforce_eager
            and config.role.cuda_graphs_allowed
            and device.type == "cuda"
            and (ep is None or ep.capturable)
        )
        self.graphs = None  # decode CUDA graphs, captured after the cache exists
        self.draft_graphs = None  # the draft (MTP) layer's decode graphs, on an engine that drafts
        self.forward_event: Optional[torch.cuda.Event] = None
        """Recorded after the last launched forward (CUDA): KV of that step is written once it completes."""
        self.want_layer_events = False
        """Record an event per decoder layer of prefill forwards (a PE sending KV layer by layer)."""
        self.layer_events: Optional[list] = None
        """The last forward's per-layer KV-written events (see `AttentionMetadata.kv_written`)."""
        self.last_input: Optional[ModelInput] = None
        self.last_hidden: Optional[torch.Tensor] = None
        """The last launched step's inputs and target hidden states [T, H] (a draft model reads them)."""

    # ---- step -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutputs, rows: list[list[SamplingRow]], fill: Optional[PlaceholderFill] = None
    ) -> StepHandle:
        """Queue the forward and the sampling of a step. `rows[i]`: sampling rows of seq i.
        `fill`: input tokens to take from the previous step's samples on the device."""
        assert self.cache is not None, "KV cache not initialised"
        self.apply_copies(out)
        if out.is_empty:
            if out.prompt_run:
                self._forward(placeholder_input(self.device))  # fixed beat; result discarded
            elif self.ep is not None and self.graphs is not None:
                self.graphs.run_idle()  # the captured graphs the ranks with work replay, no real token
            elif self.ep is not None:
                self.ep.dummy_forward()  # zero tokens, the same collectives as the ranks with work
            if self.ep is not None:
                self.num_dummy_steps += 1
            return StepHandle(lambda: StepResult([], [], []))
        inp = build_model_input(out.scheduled_seqs, out.num_new_tokens, self.block_size, self.device)
        if fill is not None and fill.rows:
            self._fill_placeholders(out, inp, fill)
        if self.want_layer_events and out.prompt_run:
            inp.attn_meta.kv_written = []
        hidden = self._forward(inp)
        self.last_input, self.last_hidden = inp, hidden
        self.layer_events = inp.attn_meta.kv_written
        if self.device.type == "cuda":
            self.forward_event = torch.cuda.Event()
            self.forward_event.record()
        queued = self._queue_sample(out, inp, hidden, rows)
        first_rows = dict(zip(queued.counts, itertools.accumulate(queued.counts.values(), initial=0)))
        token_ids = queued.sample.token_ids if queued.sample is not None else None
        return StepHandle(lambda: self._read_back(queued), token_ids, first_rows)

    def apply_copies(self, out: SchedulerOutputs) -> None:
        """The block and state-slot clones a schedule asks for, before its forward (forks)."""
        if out.clone_blocks:
            self.cache.copy_blocks(out.clone_blocks)
        if out.clone_states:
            self.cache.copy_state_slots(out.clone_states)

    def _fill_placeholders(self, out: SchedulerOutputs, inp: ModelInput, fill: PlaceholderFill) -> None:
        """Overwrite placeholder input tokens with the previous step's samples, on the device
        (queued behind that step's sampling: stream order makes the value ready, no host wait)."""
        ends = list(itertools.accumulate(inp.attn_meta.query_lens_cpu))
        for i in fill.rows:
            seq = out.scheduled_seqs[i]
            assert seq.num_cached_tokens + out.num_new_tokens[i] == len(seq), "a placeholder must be the last token fed"
        dst = to_device([ends[i] - 1 for i in fill.rows], torch.long, self.device)
        src = to_device(list(fill.rows.values()), torch.long, self.device)
        inp.input_ids.index_copy_(0, dst, fill.source.index_select(0, src))

    def wait_forward(self) -> None:
        """Block until the last launched forward has written its KV (a no-op on CPU)."""
        if self.forward_event is not None:
            self.forward_event.synchronize()

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        if inp.mm_embeds is not None:  # image positions take their embeddings, not their tokens'
            embeds = self.model.embed_input_ids(inp.input_ids)  # [T, H]
            embeds[inp.mm_rows] = inp.mm_embeds.to(embeds.dtype)
            return self.model(inp.input_ids, inp.positions, self.cache.kv_caches, inp.attn_meta, inputs_embeds=embeds)
        if self.graphs is not None and inp.attn_meta.is_decode_only and self.graphs.can_run(inp):
            return self.graphs.run(inp)
        return self.model(inp.input_ids, inp.positions, self.cache.kv_caches, inp.attn_meta)

    def _queue_sample(self, out: SchedulerOutputs, inp: ModelInput, hidden: torch.Tensor, rows) -> _QueuedStep:
        """Queue logits, sampling and logprobs on the device; nothing is read back."""
        n = len(out.scheduled_seqs)
        sampling = [i for i in range(n) if rows[i]]
        queued = _QueuedStep(n, {i: len(rows[i]) for i in sampling})
        if sampling:
            assert len(sampling) == len(inp.sample_indices), "sampling rows disagree with the step"
            index = to_device(inp.sample_indices, torch.long, hidden.device)
            logits = self.model.compute_logits(hidden[index])  # [S, V]
            if any(len(rows[i]) > 1 for i in sampling):  # n > 1: one row per sample
                repeat = [k for k, i in enumerate(sampling) for _ in rows[i]]
                logits = logits.index_select(0, to_device(repeat, torch.long, logits.device))
            flat = [r for i in sampling for r in rows[i]]
            queued.sample = self.sampler.queue(logits, flat)
        for b, row0, count, _ in inp.prompt_logprob_spans:
            queued.prompt_logprobs[b] = self._prompt_logprobs(out, b, hidden[row0 : row0 + count])
        return queued

    @staticmethod
    def _read_back(queued: _QueuedStep) -> StepResult:
        """The sample-end sync: copy the step's samples and logprobs to the host."""
        n = queued.num_seqs
        result = StepResult([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
        if queued.sample is not None:
            sampled: SamplerOutput = queued.sample.to_host()
            k = 0
            for i, count in queued.counts.items():
                for _ in range(count):
                    result.token_ids[i].append(sampled.token_ids[k])
                    if sampled.logprobs is not None:
                        result.logprobs[i].append(sampled.logprobs[k])
                        result.top_logprobs[i].append(sampled.top_logprobs[k] if sampled.top_logprobs else None)
                    k += 1
        for b, lps in queued.prompt_logprobs.items():
            result.prompt_logprobs[b] = lps.to_host()[1]
        return result

    def _prompt_logprobs(self, out: SchedulerOutputs, b: int, hidden: torch.Tensor) -> QueuedLogprobs:
        seq = out.scheduled_seqs[b]
        start = seq.num_cached_tokens
        targets = to_device(seq.token_slice(start + 1, start + 1 + hidden.shape[0]), torch.long, hidden.device)
        logits = self.model.compute_logits(hidden)  # [L, V]
        return queue_logprobs(logits, targets, [seq.params.prompt_logprobs] * hidden.shape[0])

    # ---- memory profile -----------------------------------------------------------------
    def profile_shapes(self) -> list[tuple[int, int]]:
        """(new tokens, context length) per dummy sequence of the peak-memory forward.

        The role's largest forward carries `max_step_tokens`. PROMPT/NORMAL: prefill shapes filling
        it with sequences up to max_model_len. COMPLETION: decode shapes, max_num_seqs sequences
        of 1 + nextn tokens.
        """
        sched = self.config.scheduler
        if self.config.role.peak_step == "decode":
            k = sched.num_decode_tokens_per_seq
            return [(k, k)] * (sched.max_step_tokens // k)
        budget, shapes = sched.max_step_tokens, []
        while budget > 0 and len(shapes) < sched.max_num_seqs:
            n = min(budget, sched.max_model_len)
            shapes.append((n, n))
            budget -= n
        return shapes

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward + logits at the role's peak shapes, over a scratch KV cache."""
        shapes = self.profile_shapes()
        blocks_per_seq = [(ctx + self.block_size - 1) // self.block_size for _, ctx in shapes]
        scratch = CacheEngine(
            self.model.num_kv_cache_layers,
            self.model.kv_cache_block_shape(self.block_size),
            sum(blocks_per_seq),
            self.config.model.dtype,
            self.device,
        )
        from deepinfer_core.sampling_params import SamplingParams
        from deepinfer_core.sequence import Sequence

        seqs, first = [], 0
        for i, ((n, _), nb) in enumerate(zip(shapes, blocks_per_seq)):
            seq = Sequence(i, f"profile-{i}", [0] * n, SamplingParams(max_tokens=1))
            seq.block_table = list(range(first, first + nb))
            first += nb
            seqs.append(seq)
        inp = build_model_input(seqs, [n for n, _ in shapes], self.block_size, self.device)
        hidden = self.model(inp.input_ids, inp.positions, scratch.kv_caches, inp.attn_meta)
        self.model.compute_logits(hidden[inp.sample_indices])
        del scratch
