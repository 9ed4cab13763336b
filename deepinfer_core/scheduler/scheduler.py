"""The scheduler: queues waiting / prompted / running and the three role branches.

- waiting: sequences that need a prefill pass (new, mid-chunk, or preempted for recompute; on a CE,
  only its local prefills of short prompts).
- prompted: sequences whose prefix KV is complete (`num_cached_tokens == len - 1`),
  e.g. handed off by a PE or forked; they join `running` at the next decode step.
- running: decoding sequences.
- loading: new sequences whose stored prefix is being read from the KV store (`kv_loader`, a PE
  with a store); they return to the head of `waiting` with that prefix in their blocks.

`_schedule()` switches on the role (SPEC §3). NORMAL engines with data parallelism vote
on the step kind so every rank takes the same kind (see `dp_vote.py`).
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from typing import TYPE_CHECKING, Optional

from deepinfer_core.config import CacheConfig, SchedulerConfig
from deepinfer_core.roles import EngineType, role_profile
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.block_manager import BlockManager
from deepinfer_core.scheduler.dp_vote import DPVote
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.state_slots import StateSlots
from deepinfer_core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from deepinfer_core.kvstore.loader import StoreLoader
    from deepinfer_core.spec_decode.slots import DraftSlots

_LOAD_WAIT_S = 0.005
"""With nothing else to prefill, how long a schedule waits for a store load before an empty step."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        dp_vote: Optional[DPVote] = None,
        num_state_slots: int = 0,
    ):
        self.role = role_profile(config.engine_type)
        if self.role.requires_stop_preempted_request and not config.stop_preempted_request:
            # SchedulerConfig refuses this too; kept here because the scheduler is the piece
            # that would otherwise park a preempted request in `waiting` forever.
            raise ValueError(f"{config.engine_type.name} engine requires stop_preempted_request=True")
        self.config = config
        self.engine_type = config.engine_type
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.dp_vote = dp_vote
        self.state_slots = StateSlots(num_state_slots)
        self.draft_slots: Optional[DraftSlots] = None
        """Speculative slot pool (set by an engine that drafts); a slot is freed with its sequence's blocks."""
        self.waiting: deque[Sequence] = deque()
        self.prompted: deque[tuple[Sequence, bool]] = deque()  # (seq, forked)
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.kv_loader: Optional[StoreLoader] = None
        """Loads stored prefixes at admission (set by an engine with a KV store)."""
        self._finished: list[Sequence] = []  # ended since the last schedule; released next step
        self._ids = itertools.count(1 << 32)  # ids for forks; requests bring their own
        self.decode_step = 0  # decode steps since the last prefill step (DP vote points)
        self.expert_balance_steps = 0
        """Steps an expert-parallel load balancer counts toward its next rearrangement (SPEC §1, §6);
        which steps count is the role's `eplb_counts_every_step`."""
        self.num_preemptions = 0

    # ---- admission ---------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        """The only way into `waiting`. NORMAL reserves capacity for the whole generation."""
        if self.role.reserves_capacity_on_add:
            max_out = seq.params.max_tokens or (self.config.max_model_len - len(seq))
            seq.reserved_block_capacity = self.block_manager.blocks_needed(len(seq) + max_out) + 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prompted or self.running or self._finished or self.loading)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prompted) + len(self.running) + len(self.loading)

    # ---- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutputs:
        out = self._schedule()
        out.finished_seqs, self._finished = self._finished, []
        if out.prompt_run:
            self.decode_step = 0
        else:
            self.decode_step += 1
        if self.role.eplb_counts_every_step or self.decode_step > 1:  # NORMAL: not a prefill step, nor the next
            self.expert_balance_steps += 1
        return out

    def _schedule(self) -> SchedulerOutputs:
        if self.engine_type == EngineType.PROMPT:
            return self._schedule_prefill()  # never None for PROMPT: an empty prefill step is legal
        if self.engine_type == EngineType.COMPLETION:
            # local prefills (conditional disaggregation) are the only way into a CE's `waiting`
            out = self._schedule_prefill() if self.waiting and self.role.prefills_short_prompts else None
            return out if out is not None else self._schedule_decode()
        if self.engine_type == EngineType.NORMAL:
            if self.dp_vote is None:
                out = self._schedule_prefill()
                return out if out is not None else self._schedule_decode()
            return self.dp_vote.schedule(
                self.decode_step, self.wants_prefill, self._schedule_prefill, self._schedule_decode
            )
        raise RuntimeError(f"unknown engine_type {self.engine_type!r}")

    def wants_prefill(self) -> bool:
        """Input to the DP vote: prefill work is waiting and KV usage is under the watermark."""
        return bool(self.waiting) and self.block_manager.usage <= self.config.prefill_kv_watermark

    def _schedule_prefill(self) -> Optional[SchedulerOutputs]:
        self._admit_loaded()
        out = SchedulerOutputs(prompt_run=True)
        started, chunked = self._pick_prefills(out)
        if started and not chunked:  # a short wait lets the loads just started join this step
            self._admit_loaded(wait_s=self.kv_loader.join_wait_s)
            self._pick_prefills(out)
        if not self.role.empty_prefill_returns_output and not out.scheduled_seqs and not out.ignored_seqs:
            return None  # NORMAL: let _schedule fall through to decode
        return out

    def _pick_prefills(self, out: SchedulerOutputs) -> tuple[int, bool]:
        """Take sequences from the head of `waiting` into `out` within the step's token budget.
        Returns (stored-prefix loads started, whether a chunked prompt ended the pick)."""
        # a CE's local prefills stay within its decode-sized forward bound (equal to the budget elsewhere)
        budget = min(self.config.max_num_batched_tokens, self.config.max_step_tokens) - out.num_batched_tokens
        num_seqs, started = len(self.running), 0
        while self.waiting and num_seqs < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if len(seq) > self.config.prompt_limit and not seq.output_token_ids:
                self.waiting.popleft()
                self._finish(seq, SequenceStatus.FINISHED_IGNORED)
                seq.error = f"prompt of {len(seq)} tokens exceeds the limit of {self.config.prompt_limit}"
                out.ignored_seqs.append(seq)
                continue
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq) or not self.state_slots.can_allocate():
                    break
                self.block_manager.allocate(seq)
                if seq.state_id < 0:
                    seq.state_id = self.state_slots.allocate()
                if self.kv_loader is not None and self.kv_loader.start(seq):
                    self.waiting.popleft()
                    self.loading.append(seq)
                    started += 1
                    continue
            n = seq.num_uncomputed_tokens
            is_chunked = n > budget
            if is_chunked and not self.config.chunked_prefill:
                break
            n = min(n, budget)
            if n == seq.num_uncomputed_tokens:  # this step completes the prompt
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                num_seqs += 1
            out.scheduled_seqs.append(seq)
            out.num_new_tokens.append(n)
            out.num_batched_tokens += n
            budget -= n
            if is_chunked:
                # NORMAL: leave the rest of the budget alone, a decode step follows soon.
                # PROMPT: the chunked request is at the head of waiting; nothing else fits.
                return started, True
        return started, False

    def _admit_loaded(self, wait_s: Optional[float] = None) -> None:
        """Loads that ended put their sequences back at the head of `waiting`, in arrival order.
        `wait_s`: how long to wait for one to end (default: a moment when nothing else waits)."""
        if not self.loading:
            return
        if wait_s is None:
            wait_s = 0.0 if self.waiting else _LOAD_WAIT_S
        for seq in reversed(self.kv_loader.poll(wait_s=wait_s)):
            self.loading.remove(seq)
            self.waiting.appendleft(seq)

    def _schedule_decode(self) -> SchedulerOutputs:
        out = SchedulerOutputs(prompt_run=False)
        self._admit_prompted(out)
        step_tokens = self.config.num_decode_tokens_per_seq
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget >= step_tokens:
            seq = self.running[i]
            if seq.is_finished:  # ended by an abort between steps
                self.running.pop(i)
                continue
            while not self.block_manager.can_append_slot(seq, step_tokens):
                if not self._preempt_newest(self.running[i:], out):  # never one already scheduled
                    break
            if seq not in self.running[i : i + 1]:  # it was the newest and got preempted
                continue
            if not self.block_manager.can_append_slot(seq, step_tokens):
                break
            self.block_manager.append_slots(seq, step_tokens)
            out.scheduled_seqs.append(seq)
            out.num_new_tokens.append(seq.num_uncomputed_tokens)
            budget -= step_tokens
            i += 1
        out.num_batched_tokens = sum(out.num_new_tokens)
        return out

    def _admit_prompted(self, out: SchedulerOutputs) -> None:
        """prompted -> running; a forked entry first gets a private copy of its last block."""
        while self.prompted and len(self.running) < self.config.max_num_seqs:
            seq, forked = self.prompted[0]
            if forked:
                if not self._make_private(seq, out):
                    break
            self.prompted.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _make_private(self, seq: Sequence, out: SchedulerOutputs) -> bool:
        """A fork gets its own state slot (a clone) and its own copy of a shared last block."""
        shared = self._last_block_shared(seq)
        if (shared and self.block_manager.num_free_blocks < 1) or not self.state_slots.can_allocate():
            return False
        if shared:
            src = seq.block_table[-1]
            dst = self.block_manager.allocate_block()
            self.block_manager.release_block(src)
            seq.block_table[-1] = dst
            out.clone_blocks.append((src, dst))
        if self.state_slots.enabled:
            seq.state_id = self.state_slots.allocate()
            if seq.state_src >= 0:
                out.clone_states.append((seq.state_src, seq.state_id))
        return True

    def _last_block_shared(self, seq: Sequence) -> bool:
        """The next token lands in a block another sequence also holds."""
        next_pos = len(seq) - 1
        idx = next_pos // self.block_manager.block_size
        return idx < len(seq.block_table) and self.block_manager.ref_counts[seq.block_table[idx]] > 1

    def _preempt_newest(self, candidates: list[Sequence], out: SchedulerOutputs) -> bool:
        """Free the most recently arrived candidate's KV (last come, first preempted)."""
        if not candidates:
            return False
        victim = max(candidates, key=lambda s: s.arrival_time)
        self.running.remove(victim)
        self.free_seq(victim)
        self.num_preemptions += 1
        if self.config.stop_preempted_request:
            victim.error = "preempted: the KV cache is full"
            self._finish(victim, SequenceStatus.FINISHED_PREEMPTED, blocks_freed=True)
            out.preempted_seqs.append(victim)
        else:
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
        return True

    # ---- forks, ends, aborts ------------------------------------------------------------
    def fork_seq(
        self,
        seq: Sequence,
        blocks: Optional[list[int]] = None,
        sampling_params: Optional[SamplingParams] = None,
        seq_id: Optional[int] = None,
        request_id: Optional[str] = None,
        index: Optional[int] = None,
        output_token_ids: Optional[list[int]] = None,
    ) -> Sequence:
        """A new sequence that shares `seq`'s computed prefix (its blocks, or `blocks`).

        An incomplete prompt goes to the front of `waiting`; a complete one
        (`num_cached_tokens == len - 1`) to `prompted`, marked forked.
        """
        if seq.num_cached_tokens <= 0:
            raise ValueError("cannot fork a sequence without a computed prefix")
        params = sampling_params or seq.params
        if params.prompt_logprobs:
            raise ValueError("forking a cached prefix does not support prompt_logprobs")
        if blocks is not None and not blocks:
            raise ValueError("cannot fork a sequence without allocated KV blocks")
        child = copy.copy(seq)
        child.seq_id = next(self._ids) if seq_id is None else seq_id
        child.request_id = request_id or seq.request_id
        child.index = seq.index if index is None else index
        child.params = params
        child.output_token_ids = list(seq.output_token_ids if output_token_ids is None else output_token_ids)
        child.block_hashes = list(seq.block_hashes)
        child.output_logprobs, child.output_top_logprobs = [], []
        child.first_token_time = None
        child.generator = None
        child.state_id, child.state_src = -1, seq.state_id
        child.spec_slot = -1  # drafts are the parent's
        self.block_manager.adopt_blocks(child, seq.block_table if blocks is None else blocks)
        if child.num_cached_tokens < len(child) - 1:
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
        else:
            self.prompted.append((child, True))
        return child

    def add_prompted(self, seq: Sequence) -> None:
        """Enqueue a sequence whose prefix KV is already in its blocks (a CE's hand-off)."""
        if seq.num_cached_tokens != len(seq) - 1:
            raise ValueError(
                f"a prompted sequence needs num_cached_tokens == len - 1, got {seq.num_cached_tokens} of {len(seq)}"
            )
        if seq.state_id < 0:
            seq.state_id = self.state_slots.allocate()
        self.prompted.append((seq, False))

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark a sequence done; its blocks are released at the next step.

        Usually a running one. A fork whose first token ends it is still in `prompted`; with
        zero-overhead scheduling a sequence preempted for recompute can end in `waiting` when
        the token it sampled just before the preemption comes back."""
        self._finish(seq, status)

    def retire_seq(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence whose in-flight token is known to end it (a length
        cap, decided from counts alone) and release its blocks at the next step, as if it had
        finished: zero-overhead scheduling does not learn the token's value before the next
        schedule. `finish_seq` sets the final status once the token is back; until then the
        sequence's last token is a placeholder, past its computed KV."""
        self.running.remove(seq)
        if seq.block_table and seq not in self._finished:
            self._finished.append(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus, blocks_freed: bool = False) -> None:
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            entry = next((e for e in self.prompted if e[0] is seq), None)
            if entry is not None:
                self.prompted.remove(entry)
        if blocks_freed or not seq.block_table or seq in self._finished:
            return
        self._finished.append(seq)

    def free_seq(self, seq: Sequence) -> None:
        """Return a finished sequence's blocks and state slot (the default `finalize_seq`)."""
        self.block_manager.free(seq)
        self.state_slots.free(seq.state_id)
        seq.state_id = -1
        if self.draft_slots is not None:
            self.draft_slots.free(seq)

    def remove_seq(self, seq: Sequence) -> None:
        """Drop a sequence from every queue without touching its blocks (a PE's hand-off)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self._finished:
            self._finished.remove(seq)

    def abort_seq(self, request_id: str) -> list[Sequence]:
        """End every sequence of a request. Queued ones free now; running ones next step."""
        aborted = []
        for seq in [s for s in self.loading if s.request_id == request_id]:
            self.loading.remove(seq)
            self.kv_loader.cancel(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.free_seq(seq)
            aborted.append(seq)
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.free_seq(seq)
            aborted.append(seq)
        for entry in [e for e in self.prompted if e[0].request_id == request_id]:
            self.prompted.remove(entry)
            entry[0].status = SequenceStatus.FINISHED_ABORTED
            self.free_seq(entry[0])
            aborted.append(entry[0])
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            aborted.append(seq)
        return aborted

    def commit_computed(self, seq: Sequence) -> None:
        """After a step: publish newly full blocks to the prefix cache."""
        self.block_manager.commit_full_blocks(seq)
