"""LLMEngine: one engine class, three roles (SPEC §1), one step with a fixed hook timeline (SPEC §2).

`PromptEngine` and `CompletionEngine` subclass it and fill the hooks; nothing else is copied.
`step()` runs either synchronously (`_step_sync`, SPEC §2 as written) or with zero-overhead
scheduling (`_step_overlapped`: the next step is launched before this one is read back; see
`overlap.py` for the timeline, the one-beat output delay and the fallbacks).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Optional

import torch

from deepinfer_core import envs
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine import overlap
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.engine.overlap import InFlightStep
from deepinfer_core.engine.request_state import RequestState
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.engine_type import EngineType
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.sampler import SamplingRow
from deepinfer_core.sampling.stop_checker import check_stop
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.dp_vote import DPVote
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.sequence import Sequence, SequenceStatus
from deepinfer_core.worker.events import DeviceEvent, launch_async
from deepinfer_core.worker.model_runner import StepResult
from deepinfer_core.worker.worker import Worker

if TYPE_CHECKING:
    from deepinfer_core.pd.prompt_engine import HandoffResult
    from deepinfer_core.transfer.nixl_agent import NixlKVAgent

logger = logging.getLogger(__name__)


class LLMEngine:
    agent: Optional[NixlKVAgent] = None
    """The KV transfer agent of a PE or CE (set by `init_pd_split`); None on a NORMAL engine."""

    def __init__(self, config: EngineConfig, tokenizer=None, dp_group=None):
        self.config = config
        self.engine_type = config.engine_type
        self.role = config.role
        if config.parallel.context_parallel_size > 1:
            assert self.engine_type != EngineType.COMPLETION, "a COMPLETION engine cannot use context parallelism"
        self.name = f"{self.engine_type.name}_{config.device}"
        logger.info("starting engine %s (role %s, model %s)", self.name, self.engine_type.name, config.model.path)
        # A PE hands each prefilled sequence off in its step's own post-process (SPEC §2), so its
        # steps never overlap, whatever the environment says.
        self.zero_overhead_scheduling = (
            envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING and self.engine_type != EngineType.PROMPT
        )
        """Read at every step: switching it off finishes the step in flight first."""
        if envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING and not self.zero_overhead_scheduling:
            logger.info("zero-overhead scheduling stays off on a PROMPT engine")
        self._step_in_flight: Optional[InFlightStep] = None
        """Zero-overhead scheduling: the launched step whose tokens are not read back yet."""
        self._resolving_step: Optional[InFlightStep] = None
        """The in-flight step being post-processed (its sequences were advanced already)."""
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.worker = Worker(config)
        self.mm_processor = self._build_mm_processor()
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self.copy_state_event: Optional[DeviceEvent] = None
        self._init_cache(dp_group)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(args.create_engine_config(), **kwargs)

    def _load_tokenizer(self):
        from deepinfer_core.tokenizer import load_tokenizer

        return load_tokenizer(self.config.model.tokenizer or self.config.model.path)

    def _init_cache(self, dp_group) -> None:
        num_blocks = self.worker.determine_num_blocks()
        self.cache = self.worker.init_cache(num_blocks)
        dp_vote = None
        if self.engine_type == EngineType.NORMAL and self.config.parallel.data_parallel_size > 1:
            dp_vote = DPVote(dp_group)
        slots = self.cache.states.shape[0] if self.cache.states is not None else 0
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks, dp_vote, slots)
        if self.role.init_pd_split:
            self.init_pd_split()

    @property
    def copy_state(self) -> Optional[torch.Tensor]:
        """The copy area of the state slots; None when the model keeps no per-sequence state."""
        return self.cache.copy_states

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Optional[str] = None,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        arrival_time: Optional[float] = None,
        enqueue: bool = True,
        multi_modal_data: Optional[dict] = None,
    ) -> Sequence:
        """Admit a request. With `enqueue=False` the sequence is built but not queued
        (a CE enqueues it once its KV has arrived; rejecting before that needs no rollback).
        `multi_modal_data`: {"image": image(s)} or {"image_embeds": ...}, one per placeholder token."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        ids, images = self._image_inputs(ids, multi_modal_data, computes_prompt=enqueue)
        params = self._resolve_params(params, len(ids))
        seq = Sequence(next(self._seq_ids), request_id, ids, params, eos_token_id=self._eos_id())
        seq.mm_placeholders = images
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        state = RequestState(request_id, prompt, ids, params, seqs=[seq])
        if params.seed is not None:
            state.generators = [_generator(params.seed + i, self.worker.device) for i in range(params.n)]
            seq.generator = state.generators[0]
        self._attach_detokenizer(state, seq)
        self.requests[request_id] = state
        if enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def _prompt_ids(self, prompt: Optional[str], prompt_token_ids: Optional[list[int]]) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = int(self.config.model.hf_config["vocab_size"])
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len is {limit} (prompt + at least one output token)"
            )
        return ids

    def _build_mm_processor(self):
        """The image processor of a multimodal model; none on roles without a multimodal pool."""
        if not envs.DEEPINFER_USE_MULTIMODAL_POOL or not hasattr(self.worker.model, "encode_images"):
            return None
        from deepinfer_core.multimodal.processor import MultiModalProcessor

        return MultiModalProcessor.for_model(self.worker.model, self.config.model.path, self.worker.device)

    def _image_inputs(
        self, ids: list[int], multi_modal_data: Optional[dict], computes_prompt: bool
    ) -> tuple[list[int], list]:
        """(prompt ids with image placeholders expanded, the images bound to their positions).
        A sequence whose prompt KV arrives from elsewhere (`computes_prompt=False`) needs no images."""
        if self.mm_processor is None:
            if multi_modal_data:
                raise ValueError(f"engine {self.name} takes no images (text-only model, or no multimodal pool)")
            return ids, []
        if not multi_modal_data:
            if computes_prompt:
                self.mm_processor.check_text_only(ids)
            return ids, []
        ids, images = self.mm_processor.process(ids, multi_modal_data)
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens with its images expanded; max_model_len is {limit}")
        return ids, images

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.config.scheduler.max_model_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone()
            params.max_tokens = room if params.max_tokens is None else params.max_tokens
        return params

    def _eos_id(self) -> Optional[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = self.config.model.hf_config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos

    def _attach_detokenizer(self, state: RequestState, seq: Sequence) -> None:
        if self.tokenizer is None or not seq.params.detokenize:
            return
        from deepinfer_core.detokenizer import IncrementalDetokenizer

        state.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_seq(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._step_in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- what a host (a worker, the P/D harness) drives and reads between steps ---------------
    def poll_handoffs(self) -> list[RequestOutput]:
        """Drive the KV transfer plane between steps; outputs it produced (a CE's hand-offs)."""
        return []

    def pop_handoff_results(self) -> list[HandoffResult]:
        """Hand-offs completed since the last call (a PE's); empty elsewhere."""
        return []

    @property
    def awaits_handoffs(self) -> bool:
        """Hand-off notices may arrive while idle: the host should poll often (a CE with leases)."""
        return False

    def load(self) -> EngineLoad:
        """The engine's load now; call on the engine's thread."""
        sched = self.scheduler
        bm = sched.block_manager
        prompted = [entry[0] for entry in sched.prompted]
        return EngineLoad(
            queued_prompt_tokens=sum(s.num_uncomputed_tokens for s in sched.waiting),
            running_requests=len(sched.running) + len(prompted),
            waiting_requests=len(sched.waiting),
            total_kv_tokens=sum(len(s) for s in sched.running) + sum(len(s) for s in prompted),
            kv_usage=bm.usage,
            free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            requests=len(self.requests),
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
        )

    # ---- the step (SPEC §2) -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.zero_overhead_scheduling:
            return self._step_overlapped()
        outputs = self._finish_step_in_flight()  # overlap was switched off with a step in flight
        return outputs + self._step_sync()

    def _step_sync(self) -> list[RequestOutput]:
        out = self._schedule_step()
        handle = self.worker.runner.launch(out, self._sampling_rows(out))
        self.pre_sampler_sync(out)
        result = handle.result()  # the sample-end synchronisation
        return self.post_process(out, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch step C, then read back and post-process step P, launched by the previous call;
        C stays in flight. Returns P's outputs (one beat later than `_step_sync`)."""
        prev, self._step_in_flight = self._step_in_flight, None
        outputs: list[RequestOutput] = []
        if prev is not None and self._advance(prev):
            outputs, prev = self._resolve(prev), None  # fallback: C's schedule must see P's tokens
        out = self._schedule_step()
        rows = self._sampling_rows(out)
        handle = self.worker.runner.launch(out, rows, overlap.placeholder_fill(prev, out))
        # finalize_seq here may release blocks that P (and C, for a sequence P's token ends) still
        # write: whoever gets them next is launched later on the same stream, so those writes land
        # first; on CPU every launch has completed when it returns.
        self.pre_sampler_sync(out)
        current = InFlightStep.launched(out, handle, rows)
        if prev is not None:
            outputs += self._resolve(prev)  # P's sample-end sync, while C runs on the device
        if out.is_empty:  # no device work to overlap with: finish it now
            outputs += self._advance_and_resolve(current)
        else:
            self._step_in_flight = current
        return outputs

    def _schedule_step(self) -> SchedulerOutputs:
        out = self.scheduler.schedule()
        self.post_schedule(out)
        if not out.prompt_run and self.copy_state is not None:
            to_copy = [s for s in out.scheduled_seqs if self.should_copy_state(s)]
            if to_copy:
                self.do_copy_state(to_copy)
        if self.engine_type == EngineType.PROMPT and not out.is_empty:
            assert out.prompt_run, "a PROMPT engine only runs prefill steps"
        return out

    def _advance(self, step: InFlightStep) -> bool:
        """Move an in-flight step's sequences on without its tokens (what `post_process` does
        before the samples): computed length, prefix-cache commit, and a placeholder per sample.
        Returns True when the next schedule must see the step's tokens (`overlap` fallbacks)."""
        out = step.out
        for i, seq in enumerate(out.scheduled_seqs):
            if seq.request_id not in self.requests or seq.is_finished:
                continue  # aborted, or ended by the step before this one: this step's sample is dropped
            step.live.add(i)
            seq.num_cached_tokens += out.num_new_tokens[i]
            assert not overlap.has_placeholder(seq)  # so the committed blocks hold real tokens only
            self.scheduler.commit_computed(seq)
            if step.num_rows[i]:
                overlap.append_placeholder(seq)
                step.pending[i] = seq
        if overlap.must_resolve_before_schedule(step):
            return True
        max_len = self.config.scheduler.max_model_len
        for i, seq in step.pending.items():
            # Its sample ends it whatever the value: free its blocks and skip it from the next
            # schedule on, as the synchronous step would (a fan-out needs its blocks to fork).
            if step.num_rows[i] == 1 and seq in self.scheduler.running and overlap.ends_by_length(seq, max_len):
                self.scheduler.retire_seq(seq)
        return False

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Read an advanced step back (its sample-end sync) and post-process it."""
        result = step.handle.result()
        self._resolving_step = step
        try:
            return self.post_process(step.out, result)
        finally:
            self._resolving_step = None

    def _advance_and_resolve(self, step: InFlightStep) -> list[RequestOutput]:
        self._advance(step)
        return self._resolve(step)

    def _finish_step_in_flight(self) -> list[RequestOutput]:
        step, self._step_in_flight = self._step_in_flight, None
        return self._advance_and_resolve(step) if step is not None else []

    def pre_sampler_sync(self, out: SchedulerOutputs) -> None:
        if not out.prompt_run:
            if self.copy_state_event is not None:
                self.copy_state_event.synchronize()
            self.do_save_kvcache(out.scheduled_seqs, out.finished_seqs)
        else:
            self.pe_prepare_save_kvcache(out.scheduled_seqs, out.finished_seqs)
        if self.role.finalizes_finished_seqs:
            for seq in out.finished_seqs:
                self.finalize_seq(seq)

    def post_process(self, out: SchedulerOutputs, result: StepResult) -> list[RequestOutput]:
        # An overlapped step's sequences were moved on by `_advance` already (computed length,
        # prefix commit, placeholders); here its tokens replace the placeholders.
        advanced = (
            self._resolving_step if self._resolving_step is not None and self._resolving_step.out is out else None
        )
        touched: dict[str, RequestState] = {}
        samples = [out.samples(i) for i in range(len(out.scheduled_seqs))] if advanced is None else None
        for i, seq in enumerate(out.scheduled_seqs):
            state = self.requests.get(seq.request_id)
            if state is None:  # aborted while the step ran
                continue
            if advanced is None:
                seq.num_cached_tokens += out.num_new_tokens[i]
                self.scheduler.commit_computed(seq)
                if samples[i]:
                    self._take_samples(state, seq, result, i)
            elif i not in advanced.live:
                continue  # it had ended before this step was advanced: its sample is dropped
            elif i in advanced.pending:
                self._take_samples(state, seq, result, i, placeholder=True)
            if i in result.prompt_logprobs:
                state.prompt_logprobs = (state.prompt_logprobs or [None]) + result.prompt_logprobs[i]
            touched[seq.request_id] = state
        for seq in out.ignored_seqs + out.preempted_seqs:
            if seq.request_id in self.requests:
                touched[seq.request_id] = self.requests[seq.request_id]
        outputs = [state.to_output() for state in touched.values()]
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        if out.prompt_run:
            self.pe_do_save_kvcache(out.scheduled_seqs, out.finished_seqs)
        if self.engine_type == EngineType.PROMPT:
            self.send_processed_prompts()
        return outputs

    # ---- sampling and stop rules ----------------------------------------------------------
    def _sampling_rows(self, out: SchedulerOutputs) -> list[list[SamplingRow]]:
        rows: list[list[SamplingRow]] = []
        for i, seq in enumerate(out.scheduled_seqs):
            if not out.samples(i):
                rows.append([])
                continue
            state = self.requests.get(seq.request_id)
            if overlap.needs_output_values(seq.params):  # penalties count token values
                assert not overlap.has_placeholder(seq), "penalised sampling needs the in-flight token (overlap.py)"
            fan_out = state is not None and seq.params.n > 1 and not state.forked
            gens = (
                state.generators if fan_out and state.generators else [seq.generator] * (seq.params.n if fan_out else 1)
            )
            rows.append(
                [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, g, seq.eos_token_id) for g in gens]
            )
        return rows

    def _take_samples(
        self, state: RequestState, seq: Sequence, result: StepResult, i: int, placeholder: bool = False
    ) -> None:
        """Append the step's samples of seq i; `placeholder`: its first sample replaces its placeholder."""
        tokens = result.token_ids[i]
        lps = result.logprobs[i] or [None] * len(tokens)
        tops = result.top_logprobs[i] or [None] * len(tokens)
        if len(tokens) > 1:  # first tokens of an n > 1 request: fork the other samples
            state.forked = True
            for k in range(1, len(tokens)):
                params = seq.params.clone()
                params.prompt_logprobs = None  # reported once, on the request
                child = self.scheduler.fork_seq(seq, sampling_params=params, index=k, output_token_ids=[])
                child.generator = state.generators[k] if state.generators else None
                state.seqs.append(child)
                self._attach_detokenizer(state, child)
                self._append_token(state, child, tokens[k], lps[k], tops[k])
        self._append_token(state, seq, tokens[0], lps[0], tops[0], placeholder)

    def _append_token(self, state: RequestState, seq: Sequence, token: int, lp, top, placeholder: bool = False) -> None:
        if placeholder:
            overlap.resolve_placeholder(seq, token)
        else:
            seq.append_token(token)
        if lp is not None:
            seq.output_logprobs.append(lp)
            seq.output_top_logprobs.append(top)
        detok = state.detokenizers.get(seq.seq_id)
        delta = detok.add_tokens([token]) if detok is not None else ""
        seq.output_text += delta
        decision = check_stop(
            seq.params,
            seq.output_token_ids,
            seq.output_text,
            len(delta),
            seq.eos_token_id,
            seq.num_prompt_tokens,
            self.config.scheduler.max_model_len,
        )
        if not decision.finished:
            return
        if detok is not None and decision.truncate_text_to is None:
            seq.output_text += detok.flush()
        if decision.truncate_text_to is not None:
            seq.output_text = seq.output_text[: decision.truncate_text_to]
        seq.stop_reason = decision.stop_reason
        if seq.status == SequenceStatus.FINISHED_PREEMPTED:
            # Overlap only: KV ran out after this token was sampled; without overlap the token
            # would have ended the sequence first, so it is no preemption.
            seq.error = None
        status = SequenceStatus.FINISHED_STOPPED if decision.reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish_seq(seq, status)

    # ---- state copy (decode side) -----------------------------------------------------------
    def do_copy_state(self, seqs: list[Sequence]) -> None:
        """Queue copies of the given sequences' state slots into the copy area; does not wait.
        `pre_sampler_sync` synchronises `copy_state_event` before `do_save_kvcache` reads it."""
        if self.copy_state is None:
            return
        slots = [s.state_id for s in seqs if s.state_id != -1]
        for seq in seqs:
            seq.last_copy_state_token_idx = seq.num_cached_tokens
        self.copy_state_event = launch_async(lambda: self._copy_state_slots(slots), self.worker.device)

    def _copy_state_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self.copy_state[slot].copy_(self.cache.states[slot])

    # ---- P/D hooks: defaults; PromptEngine / CompletionEngine fill them ---------------------
    def init_pd_split(self) -> None:
        pass

    def finalize_seq(self, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)

    def post_schedule(self, out: SchedulerOutputs) -> None:
        pass

    def should_copy_state(self, seq: Sequence) -> bool:
        return False

    def do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def send_processed_prompts(self) -> None:
        pass


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
