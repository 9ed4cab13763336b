"""LLMEngine: one engine class, three roles (SPEC §1), one step with a fixed hook timeline (SPEC §2).

`PromptEngine` and `CompletionEngine` subclass it and fill the hooks; nothing else is copied.
This file holds the step and its hooks; admission is `admission.py`, what a step samples and how
its tokens are taken in is `sampling_rules.py`. With zero-overhead scheduling the step one
`step()` call launches is read back by the next call, behind that call's own launch (`overlap.py`:
the timeline, the one-beat output delay and the fallbacks).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Optional

import torch

from deepinfer_core import envs
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine import overlap
from deepinfer_core.engine.admission import RequestAdmission
from deepinfer_core.engine.handoff_result import HandoffResult
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.engine.overlap import InFlightStep
from deepinfer_core.engine.request_state import RequestState
from deepinfer_core.engine.sampling_rules import SamplingRules
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.scheduler.dp_vote import DPVote
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.sequence import Sequence
from deepinfer_core.spec_decode.decoder import SpecDecoder
from deepinfer_core.worker.events import DeviceEvent, launch_async
from deepinfer_core.worker.model_runner import StepResult
from deepinfer_core.worker.worker import Worker

if TYPE_CHECKING:
    from deepinfer_core.distributed.group import InstanceGroup
    from deepinfer_core.eplb.balancer import ExpertBalancer
    from deepinfer_core.transfer.nixl_agent import NixlKVAgent

logger = logging.getLogger(__name__)


class LLMEngine(RequestAdmission, SamplingRules):
    agent: Optional[NixlKVAgent] = None
    """The KV transfer agent of a PE or CE (set by `init_pd_split`); None on a NORMAL engine."""

    def __init__(self, config: EngineConfig, tokenizer=None, dp_group=None, group: Optional[InstanceGroup] = None):
        """`group`: this rank's instance (expert parallelism: N ranks stepping in lockstep, see
        `deepinfer_core.distributed.lockstep`); `dp_group`: a process group for the DP vote alone."""
        self.config = config
        self.group = group
        self.engine_type = config.engine_type
        self.role = config.role
        if config.parallel.context_parallel_size > 1:
            assert self.role.context_parallel_allowed, (
                f"a {self.engine_type.name} engine cannot use context parallelism"
            )
        self.name = f"{self.engine_type.name}_{config.device}"
        logger.info("starting engine %s (role %s, model %s)", self.name, self.engine_type.name, config.model.path)
        self.zero_overhead_scheduling = envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING and self.role.steps_may_overlap
        """Read at every step: switching it off finishes the step in flight first."""
        if envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING and not self.zero_overhead_scheduling:
            logger.info("zero-overhead scheduling stays off on a %s engine", self.engine_type.name)
        self._step_in_flight: Optional[InFlightStep] = None
        """Zero-overhead scheduling: the launched step whose tokens are not read back yet."""
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.worker = Worker(config, group)
        self.mm_processor = self._build_mm_processor()
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self.copy_state_event: Optional[DeviceEvent] = None
        self._init_cache(dp_group)
        self.spec = self._build_spec_decoder()

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
        if self.role.votes_on_step_kind and self.config.parallel.data_parallel_size > 1:
            dp_vote = DPVote(dp_group if dp_group is not None or self.group is None else self.group.control_pg)
        slots = self.cache.states.shape[0] if self.cache.states is not None else 0
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks, dp_vote, slots)
        self.balancer = self._build_balancer()
        if self.role.init_pd_split:
            self.init_pd_split()

    def _build_spec_decoder(self) -> Optional[SpecDecoder]:
        """MTP drafting where the worker loaded a draft (the role drafts, nextn > 0); its steps need
        their accepted counts before the next schedule, so they do not overlap."""
        if self.worker.draft is None:
            return None
        nextn = self.config.scheduler.num_speculative_tokens
        logger.info("speculative decoding: MTP drafts %d token(s) per step; zero-overhead scheduling off", nextn)
        self.zero_overhead_scheduling = False
        return SpecDecoder(
            self.worker.runner, self.worker.draft, self.scheduler, nextn, self.config.scheduler.max_num_seqs
        )

    def _build_balancer(self) -> Optional[ExpertBalancer]:
        """The expert-parallel load balancer of an EP rank; None without expert parallelism."""
        if self.worker.ep is None:
            return None
        from deepinfer_core.eplb.balancer import ExpertBalancer

        return ExpertBalancer(self.worker.ep, self.config.eplb, self.role)

    @property
    def copy_state(self) -> Optional[torch.Tensor]:
        """The copy area of the state slots; None when the model keeps no per-sequence state."""
        return self.cache.copy_states

    # ---- requests (admission: `admission.py`) -------------------------------------------
    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_seq(request_id)
        self.requests.pop(request_id, None)

    def release_unused(self, request_id: str) -> None:
        """Abort a request whose KV target no PE was ever given. Only a CE holds such reservations
        (it frees their blocks at once); elsewhere this is `abort_request`."""
        self.abort_request(request_id)

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
        spec = self.spec.slots.stats if self.spec is not None else None
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
            spec_draft_tokens=spec.draft_tokens if spec else 0,
            spec_accepted_tokens=spec.accepted_tokens if spec else 0,
            spec_proposed_per_position=list(spec.proposed_at) if spec else [],
            spec_accepted_per_position=list(spec.accepted_at) if spec else [],
            **self._expert_parallel_load(),
        )

    def _expert_parallel_load(self) -> dict:
        if self.group is None:
            return {}
        balancer = self.balancer
        return dict(
            ep_rank=self.group.rank,
            ep_size=self.group.size,
            dummy_steps=self.worker.runner.num_dummy_steps,
            eplb_rearrangements=balancer.num_rearrangements if balancer else 0,
            moe_load_imbalance=(balancer.imbalance or 0.0) if balancer else 0.0,
        )

    # ---- the step (SPEC §2) -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, launch and post-process one step. With zero-overhead scheduling the step
        launched here stays in flight, and what this call returns is the previous step's outputs."""
        outputs, prev = self._settle_step_in_flight()
        out = self.scheduler.schedule()
        if self.balancer is not None:  # EPLB measures and rearranges on the role's counted steps
            self.balancer.on_step(self.scheduler.expert_balance_steps)
        self.post_schedule(out)
        if not out.prompt_run and self.copy_state is not None:
            to_copy = [s for s in out.scheduled_seqs if self.should_copy_state(s)]
            if to_copy:
                self.do_copy_state(to_copy)
        if self.role.only_prefill_steps and not out.is_empty:
            assert out.prompt_run, "a PROMPT engine only runs prefill steps"
        rows = self._sampling_rows(out)
        if self.spec is not None and not out.prompt_run and not out.is_empty:
            handle = self.spec.launch(out, rows)  # verifies last step's drafts
        else:
            handle = self.worker.runner.launch(out, rows, overlap.placeholder_fill(prev, out))
        # With a step in flight, finalize_seq here may release blocks that it (and this step, for
        # a sequence its token ends) still writes: whoever gets them next is launched later on the
        # same stream, so those writes land first; on CPU every launch has completed when it returns.
        self.pre_sampler_sync(out)
        if prev is not None:
            outputs += self._resolve(prev)  # its sample-end sync, while this step runs on the device
        if self.zero_overhead_scheduling and not out.is_empty:
            self._step_in_flight = InFlightStep.launched(out, handle, rows)
            return outputs
        result = handle.result()  # the sample-end synchronisation
        outputs += self.post_process(out, result)
        if self.spec is not None and not out.is_empty:
            self.spec.propose(out, self.requests)  # drafts for the next step
        return outputs

    def _settle_step_in_flight(self) -> tuple[list[RequestOutput], Optional[InFlightStep]]:
        """Advance the step the previous call left in flight. It is read back now (its outputs
        returned, no step left) when overlap was switched off or the next schedule needs its
        tokens (`overlap`'s fallbacks); else it is returned, to be read back behind the next launch."""
        prev, self._step_in_flight = self._step_in_flight, None
        if prev is None:
            return [], None
        needs_tokens = overlap.advance(prev, self.requests, self.scheduler, self.config.scheduler.max_model_len)
        if needs_tokens or not self.zero_overhead_scheduling:
            return self._resolve(prev), None
        return [], prev

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Read an advanced step back (its sample-end sync) and post-process it."""
        result = step.handle.result()
        return self.post_process(step.out, result, step)

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

    def post_process(
        self, out: SchedulerOutputs, result: StepResult, advanced: Optional[InFlightStep] = None
    ) -> list[RequestOutput]:
        """After the sample-end sync: the step's tokens into their sequences, the outputs of every
        request it touched, then the PE's hand-off hooks. `advanced`: the in-flight step `out` was
        launched as, whose sequences `overlap.advance` has moved on already."""
        touched = self._take_step_tokens(out, result, advanced)
        outputs = self._collect_outputs(touched, out.ignored_seqs + out.preempted_seqs)
        if out.prompt_run:
            self.pe_do_save_kvcache(out.scheduled_seqs, out.finished_seqs)
        if self.role.hands_off_prompts:
            self.send_processed_prompts()
        return outputs

    def _take_step_tokens(
        self, out: SchedulerOutputs, result: StepResult, advanced: Optional[InFlightStep]
    ) -> dict[str, RequestState]:
        """Computed lengths, prefix-cache commits and samples of the step's sequences (an advanced
        step's first two were done at advance, and its samples replace placeholders). Returns the
        requests touched, by id."""
        touched: dict[str, RequestState] = {}
        for i, seq in enumerate(out.scheduled_seqs):
            state = self.requests.get(seq.request_id)
            if state is None or (advanced is not None and i not in advanced.live):
                continue  # aborted while the step ran, or ended before it was advanced: its sample is dropped
            if advanced is None:
                samples = out.samples(i)
                seq.num_cached_tokens += out.num_new_tokens[i]
                self.scheduler.commit_computed(seq)
                if samples:
                    self._take_samples(state, seq, result, i)
            elif i in advanced.pending:
                self._take_samples(state, seq, result, i, placeholder=True)
            if i in result.prompt_logprobs:
                state.prompt_logprobs = (state.prompt_logprobs or [None]) + result.prompt_logprobs[i]
            touched[seq.request_id] = state
        return touched

    def _collect_outputs(self, touched: dict[str, RequestState], ended: list[Sequence]) -> list[RequestOutput]:
        """One output per touched request, and per request of the `ended` (refused, preempted)
        sequences; a finished request leaves the engine."""
        for seq in ended:
            if seq.request_id in self.requests:
                touched[seq.request_id] = self.requests[seq.request_id]
        outputs = [state.to_output() for state in touched.values()]
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

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
