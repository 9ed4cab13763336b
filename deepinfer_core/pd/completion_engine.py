"""CompletionEngine (CE): reserves KV blocks for a request, receives its KV from a PE, decodes.

Flow: `reserve()` builds the sequence with `add_request(enqueue=False)`, allocates blocks
for prompt + 1 tokens and returns a `KVTarget`. The PE writes the KV and then notifies;
`poll_handoffs()` reads those notices: the first token is appended, the sequence has
`num_cached_tokens == len - 1` and enters `prompted` (SPEC §3) — pure decode from here.
A reservation is a lease: if no notice arrives before its deadline the request ends with
an error. Whoever waits on the prefill renews it (`renew_reservation`, a heartbeat) while the
PE works, and the PE is told the new end (it posts no write past it): the lease itself can
be short, so a reservation whose PE or router died is let go soon. Its blocks are not reused at once: a PE may still be writing into them, so they
stay quarantined until that PE's notice arrives (the write is over) or a grace period
(longer than any PE may write past the deadline) has passed. Rejection happens before
enqueue, so nothing in the running scheduler is ever rolled back.

Conditional disaggregation: a prompt whose uncached part is short enough (`add_local_prefill`) is
prefilled here in a prefill step of its own instead (the scheduler's CE branch runs one whenever
such a prompt waits); it skips the PE and the transfer, and decodes like any other.

With a KV store (`KVStoreConfig`), `do_save_kvcache` hands the full blocks of finished sequences
(and, by `save_every_blocks`, of long-running ones) to the store (`kvstore/saver.py`): they are
copied to the store's host pool (on a GPU by a copy beside the next steps, the blocks held until
it has run) and written to files by the store's I/O thread; the step never waits for a file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.errors import CapacityError, InvalidRequestError
from deepinfer_core.kvstore import KVStore, KVStoreStats, open_store
from deepinfer_core.kvstore.keys import placeholders_from_spans
from deepinfer_core.kvstore.saver import StoreSaver
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.roles import EngineType, require_role
from deepinfer_core.sampling.sampler import replay_draws
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence, SequenceStatus
from deepinfer_core.spec_decode.handoff import decode_hidden
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.messages import HandoffNotice, KVTarget
from deepinfer_core.transfer.nixl_agent import NixlKVAgent

logger = logging.getLogger(__name__)


WRITER_GONE_GRACE_S = 1.0
"""A fenced reservation whose writer is known to be gone (`release_unused`) is freed this long
after: a write it sent just before dying may still sit in this engine's transport, applied when
the engine next makes progress (UCX over TCP), well within it."""


@dataclass
class Reservation:
    seq: Sequence
    deadline: float


class CompletionEngine(LLMEngine):
    kv_store: Optional[KVStore] = None
    """L2 + L3 of the KV cache system (None: not configured)."""

    def __init__(self, config, *args, **kwargs):
        require_role(config.engine_type, EngineType.COMPLETION, "CompletionEngine")
        self.state_copy_interval = config.pd.state_copy_interval
        self.lease_grace_s = config.pd.lease_grace_s
        """How long blocks of an expired lease stay quarantined without a notice: longer than a
        PE's transfer timeout (`PDConfig` checks it)."""
        super().__init__(config, *args, **kwargs)

    def init_pd_split(self) -> None:
        self.layout = KVLayout.of(self.config.model.hf_config, self.cache.kv_buffer, self.config.cache.block_size)
        self.agent = NixlKVAgent(self.name, self.cache.kv_buffer, self.layout)
        self.reservations: dict[str, Reservation] = {}
        self.quarantine: dict[str, Reservation] = {}  # expired leases whose blocks may still be written
        self.num_handoffs = 0
        self.num_lease_expiries = 0
        self.num_local_prefills = 0
        self.kv_store = open_store(self.config, self.cache, self.layout, self.name, self.scheduler.block_manager)
        self.kv_saver = None
        if self.kv_store is not None:
            image_token = self.config.model.hf_config.get("image_token_index")
            every = self.config.kv_store.save_every_blocks
            self.kv_saver = StoreSaver(self.kv_store, self.config.cache.block_size, every, image_token)

    # ---- reservations ----------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        prompt: Optional[str] = None,
        lease_s: Optional[float] = None,
    ) -> KVTarget:
        """Reserve blocks for prompt + 1 tokens; the returned target tells a PE where to write.
        `lease_s`: None takes `PDConfig.lease_s`.

        Raises:
            CapacityError: too few free KV blocks or state slots now (retry elsewhere or later).
            InvalidRequestError: n > 1, or what `add_request` refuses.
        """
        params = params or SamplingParams()
        lease_s = self.config.pd.lease_s if lease_s is None else lease_s
        if params.n != 1:
            raise InvalidRequestError("a decode engine takes one sample per request (n=1); fan out n before prefill")
        seq = self.add_request(request_id, prompt, params, prompt_token_ids, enqueue=False)
        bm = self.scheduler.block_manager
        needed = bm.blocks_needed(len(seq) + 1)
        if needed > bm.num_free_blocks or not self.scheduler.state_slots.can_allocate():
            self.requests.pop(request_id, None)
            raise CapacityError(
                f"decode engine {self.name} has {bm.num_free_blocks} free KV blocks; request {request_id!r} needs {needed}"
            )
        seq.block_table = [bm.allocate_block() for _ in range(needed)]
        self.reservations[request_id] = Reservation(seq, time.monotonic() + lease_s)
        expires_at = time.time() + lease_s
        return KVTarget(
            request_id=request_id,
            engine_id=self.agent.name,
            agent_metadata=self.agent.metadata,
            base_addr=self.agent.base_addr,
            num_blocks_total=self.agent.num_blocks_total,
            device_id=self.agent.device_id,
            mem_type=self.agent.mem_type,
            block_ids=list(seq.block_table),
            fingerprint=self.layout.fingerprint,
            num_prompt_tokens=len(seq),
            expires_at=expires_at,
            layout=self.layout.describe(),
        )

    def renew_reservation(self, request_id: str, lease_s: float) -> float:
        """Extend a waiting reservation's lease to `lease_s` from now (never shortened); returns its
        new end as wall-clock time (what a PE compares its clock with), 0.0 when the request holds
        no waiting reservation (handed off, expired or aborted: nothing to renew)."""
        reservation = self.reservations.get(request_id)
        if reservation is None:
            return 0.0
        now = time.monotonic()
        reservation.deadline = max(reservation.deadline, now + lease_s)
        return time.time() + (reservation.deadline - now)

    def add_local_prefill(
        self,
        request_id: str,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        resumed_tokens: int = 0,
    ) -> Sequence:
        """Conditional disaggregation: prefill a prompt here, its uncached part (past this engine's
        own prefix cache) being at most `PDConfig.local_prefill_tokens` and within one forward of
        this engine's decode bound; the request then decodes like a handed-off one.

        Raises:
            CapacityError: local prefill is off, the uncached part is too long, or there is no room
                now — the router sends the prompt to a PE instead.
            InvalidRequestError: n > 1, or what `add_request` refuses.
        """
        params = params or SamplingParams()
        limit = min(self.config.pd.local_prefill_tokens, self.config.scheduler.max_step_tokens)
        if limit <= 0:
            raise CapacityError(f"decode engine {self.name} prefills no prompt itself (local_prefill_tokens=0)")
        if params.n != 1:
            raise InvalidRequestError("a decode engine takes one sample per request (n=1); fan out n before prefill")
        seq = self.add_request(
            request_id,
            None,
            params,
            prompt_token_ids,
            enqueue=False,
            computes_prompt=True,
            resumed_tokens=resumed_tokens,
        )
        bm = self.scheduler.block_manager
        uncached = len(seq) - bm.count_cached_prefix(seq) * bm.block_size
        room = bm.can_allocate(seq) and self.scheduler.state_slots.can_allocate()
        if uncached > limit or not room or len(self.scheduler.waiting) >= self.config.scheduler.max_num_seqs:
            self.requests.pop(request_id, None)
            why = f"{uncached} uncached prompt tokens (limit {limit})" if uncached > limit else "no room now"
            raise CapacityError(f"decode engine {self.name} does not prefill request {request_id!r} itself: {why}")
        self.scheduler.add_sequence(seq)
        self.num_local_prefills += 1
        return seq

    def poll_handoffs(self) -> list[RequestOutput]:
        """Apply hand-off notices and expire leases; call between steps."""
        if self.kv_store is not None:
            self.kv_store.poll()
        outputs = []
        for _, message in self.agent.get_notifs():
            try:
                notice = HandoffNotice.from_bytes(message)
            except ValueError as e:
                logger.warning("dropping a malformed hand-off notice: %s", e)
                continue
            out = self._on_notice(notice)
            if out is not None:
                outputs.append(out)
        now = time.monotonic()
        for rid in [r for r, res in self.reservations.items() if res.deadline < now]:
            self.num_lease_expiries += 1
            outputs.append(
                self._fail(rid, "the KV cache did not arrive before the reservation lease expired", hold=True)
            )
        for rid in [r for r, res in self.quarantine.items() if res.deadline < now]:
            self.scheduler.free_seq(self.quarantine.pop(rid).seq)
        return outputs

    @property
    def awaits_handoffs(self) -> bool:
        return bool(self.reservations or self.quarantine)

    def load(self) -> EngineLoad:
        load = super().load()
        load.total_kv_tokens += sum(len(r.seq) for r in self.reservations.values())
        load.reservations = len(self.reservations)
        load.fenced_reservations = len(self.quarantine)
        load.handoffs = self.num_handoffs
        load.local_prefills = self.num_local_prefills
        if self.kv_store is not None:
            self.kv_store.stats().add_to(load)
        return load

    def kv_store_stats(self) -> Optional[KVStoreStats]:
        return self.kv_store.stats() if self.kv_store is not None else None

    def _on_notice(self, notice: HandoffNotice) -> Optional[RequestOutput]:
        late = self.quarantine.pop(notice.request_id, None)
        if late is not None:  # the PE is done with the blocks of an expired lease
            self.scheduler.free_seq(late.seq)
            return None
        reservation = self.reservations.pop(notice.request_id, None)
        if reservation is None:
            return None  # aborted
        if not notice.ok:
            self.reservations[notice.request_id] = reservation
            return self._fail(notice.request_id, f"prefill failed: {notice.error}")
        seq = reservation.seq
        if notice.num_computed_tokens != len(seq):
            self.reservations[notice.request_id] = reservation
            return self._fail(notice.request_id, f"received KV for {notice.num_computed_tokens} of {len(seq)} tokens")
        seq.num_cached_tokens = notice.num_computed_tokens
        seq.num_prefix_hit_tokens = notice.num_cached_tokens  # reported as the request's cached tokens
        if notice.image_spans:  # the images' identities, so the blocks are keyed as on the PE
            seq.mm_placeholders = placeholders_from_spans(notice.image_spans)
        self.scheduler.commit_computed(seq)
        state = self.requests[notice.request_id]
        self._append_token(state, seq, notice.first_token, notice.first_logprob, notice.first_top_logprobs)
        replay_draws(seq.generator, int(self.config.model.hf_config["vocab_size"]), seq.params)  # the PE's draw
        self.num_handoffs += 1
        if seq.is_finished:  # the first token already ended it (EOS, max_tokens=1, stop)
            if self.kv_saver is not None:  # it never reaches a step's finished list
                self.kv_saver.on_step([], [seq])
            self.scheduler.remove_seq(seq)
            self.scheduler.free_seq(seq)
        else:
            self.scheduler.add_prompted(seq)
            if self.spec is not None and notice.last_hidden:  # drafts for the first decode step
                self.spec.start_from_handoff(
                    seq, decode_hidden(notice.last_hidden, self.worker.device, self.config.model.dtype)
                )
        out = state.to_output()
        if out.finished:
            self.requests.pop(notice.request_id, None)
        return out

    def _fail(self, request_id: str, error: str, hold: bool = False) -> RequestOutput:
        """End a reserved request with an error; `hold` quarantines its blocks instead of freeing them."""
        reservation = self.reservations.pop(request_id)
        seq = reservation.seq
        if hold:
            self.quarantine[request_id] = Reservation(seq, time.monotonic() + self.lease_grace_s)
        else:
            self.scheduler.free_seq(seq)
        seq.status, seq.error = SequenceStatus.FINISHED_IGNORED, error
        state = self.requests.pop(request_id)
        return state.to_output()

    def release_unused(self, request_id: str) -> None:
        """Abort a reservation no write can land in any more: no PE was given its target, the PE
        confirmed its abort, or the PE it was given is gone (its process died). Its blocks are
        free at once (`abort_request` quarantines them, since a PE may be writing); one already
        fenced is freed `WRITER_GONE_GRACE_S` from now."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            self.scheduler.free_seq(reservation.seq)
        fenced = self.quarantine.get(request_id)
        if fenced is not None:
            fenced.deadline = min(fenced.deadline, time.monotonic() + WRITER_GONE_GRACE_S)
        self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            # A PE given the target may post writes until the lease ends (it checks the target's
            # expiry before each post), and a posted write lands within the grace: the blocks are
            # fenced until then, unless the PE's notice (done, failed, aborted) comes first.
            fence = max(reservation.deadline, time.monotonic()) + self.lease_grace_s
            self.quarantine[request_id] = Reservation(reservation.seq, fence)
        super().abort_request(request_id)

    # ---- hooks -------------------------------------------------------------------------------
    def should_copy_state(self, seq: Sequence) -> bool:
        """Copy a sequence's state each time it crosses a `state_copy_interval` token boundary."""
        return seq.num_cached_tokens - seq.last_copy_state_token_idx >= self.state_copy_interval

    def do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        """Hand the new full blocks of finished (and, by the config, long-running) sequences to the
        KV store; copies to host memory, does not wait for any file. Nothing without a store."""
        if self.kv_saver is None:
            return
        self.kv_store.poll()
        self.kv_saver.on_step(scheduled, finished)
