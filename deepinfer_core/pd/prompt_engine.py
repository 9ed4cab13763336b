"""PromptEngine (PE): prefills, samples the first token, writes the KV into a CE's blocks.

Hook bodies (SPEC §2, §4):
- post_schedule: record which sequences complete their prompt this step (to hand off),
  and which computed only a chunk of it;
- pe_prepare_save_kvcache: once the forward has written the KV, post the NIXL WRITEs
  (a request's blocks across all layers, or a layer group, in one transfer) without waiting —
  sampling still runs. A chunk that does not end its prompt sends the blocks it filled
  (DEEPINFER_PD_STREAM_CHUNKS) at the next step, behind that step's forward, so they travel
  while the next chunk computes and only the last chunk's blocks are left for the hand-off.
  Those go out in layer groups (DEEPINFER_PD_LAYER_GROUPS; CUDA): a group as soon as the
  forward has written its layers' KV (per-layer events), while the later layers compute;
- pe_do_save_kvcache: wait for each finished prompt's writes (or an error / timeout) and
  record them; reap chunk writes that have already landed;
- send_processed_prompts: notify each CE (first token, computed length, tokens not computed),
  drop the sequence from the scheduler, and only then free the PE's blocks.
With a KV store (`KVStoreConfig`), admission first loads the longest stored prefix past the prefix
cache (`kvstore/loader.py`, from the scheduler); the hand-off sends those blocks like the rest.
A PE never calls finalize_seq: its blocks are in flight until the hand-off completes, and
an abort waits for a chunk write in flight before the blocks are freed.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from deepinfer_core import envs
from deepinfer_core.engine.handoff_result import HandoffResult
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.errors import InvalidRequestError, KVTargetRejected, TransferError
from deepinfer_core.kvstore import KVStore, KVStoreStats, open_store
from deepinfer_core.kvstore.keys import image_spans
from deepinfer_core.kvstore.loader import StoreLoader
from deepinfer_core.kvstore.probe import PrefixProbe, probe_prefix
from deepinfer_core.pd.pending_write import PendingWrite
from deepinfer_core.roles import EngineType, require_role
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.sequence import Sequence
from deepinfer_core.spec_decode.handoff import encode_hidden, has_mtp_layer
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.messages import HandoffNotice, KVRegion, KVTarget
from deepinfer_core.transfer.nixl_agent import NixlKVAgent, PreparedWrite

logger = logging.getLogger(__name__)


class PromptEngine(LLMEngine):
    kv_store: Optional[KVStore] = None
    """L2 + L3 of the KV cache system (None: not configured)."""

    def __init__(self, config, *args, **kwargs):
        require_role(config.engine_type, EngineType.PROMPT, "PromptEngine")
        self.transfer_timeout_s = config.pd.transfer_timeout_s
        super().__init__(config, *args, **kwargs)

    def init_pd_split(self) -> None:
        self.layout = KVLayout.of(self.config.model.hf_config, self.cache.kv_buffer, self.config.cache.block_size)
        self.agent = NixlKVAgent(self.name, self.cache.kv_buffer, self.layout, sends=True)
        self.agent.prepare_writes()
        self.set_layer_groups(envs.DEEPINFER_PD_LAYER_GROUPS or (4 if self.cache.kv_buffer.is_cuda else 1))
        self.targets: dict[str, KVTarget] = {}
        self._departed: set[str] = set()  # CEs that left, released once no hand-off targets them
        self._handoff: list[Sequence] = []
        self._handoff_rows: list[int] = []
        self.sends_last_hidden = has_mtp_layer(self.config.model.hf_config, self.config.model.builtin)
        """Hand-offs carry the prompt's last hidden state (a CE drafts with the MTP layer from it)."""
        self._chunks: list[tuple[Sequence, int]] = []  # (seq, tokens computed once this step ends)
        self._deferred: list[tuple[Sequence, int, object]] = []  # chunks to post next step, + forward event
        self._streams: dict[str, PendingWrite] = {}  # mid-prompt requests with chunk writes posted
        self._inflight: list[PendingWrite] = []
        self._done: list[PendingWrite] = []
        self.handoff_results: list[HandoffResult] = []
        self.num_computed_prompt_tokens = 0
        self.kv_store = open_store(self.config, self.cache, self.layout, self.name)
        if self.kv_store is not None:
            store = self.config.kv_store
            loader = StoreLoader(self.kv_store, self.config.cache.block_size, store.load_timeout_s, store.join_wait_s)
            self.scheduler.kv_loader = loader

    def set_layer_groups(self, groups: int) -> None:
        """Send each finished prompt's KV in `groups` layer groups (1: one write after the forward)."""
        n = self.layout.num_layers
        groups = max(1, min(n, groups))
        bounds = [round(i * n / groups) for i in range(groups + 1)]
        self._layer_groups = [range(a, b) for a, b in zip(bounds, bounds[1:])] if groups > 1 else []
        self.worker.runner.want_layer_events = bool(self._layer_groups)

    # ---- admission ---------------------------------------------------------------------
    def connect_peer(self, name: str, metadata: bytes, region: Optional[KVRegion] = None) -> None:
        """Connect to a CE ahead of its first hand-off (at registration, not on a request's path).

        With the CE's KV `region`, its descriptor list is prepared now too, so no request pays
        for it. Raises KVTargetRejected (and connects nothing) for a CE whose KV layout differs.
        """
        if region is not None and region.fingerprint and region.fingerprint != self.layout.fingerprint:
            raise KVTargetRejected(
                f"KV layout mismatch with decode engine {name!r}: it has [{region.layout or region.fingerprint}], "
                f"this prefill engine has [{self.layout.describe()}]"
            )
        self.agent.add_peer(name, metadata, region)

    def disconnect_peer(self, name: str) -> None:
        """Forget a CE that left (died, scaled in): its agent and descriptor lists are released
        once no hand-off of ours targets it (a write still in flight finishes or fails first). A CE
        started again has an agent of a new name: it is connected as a new peer, nothing stale."""
        self._departed.add(name)
        self._release_departed()

    def _release_departed(self) -> None:
        busy = {t.engine_id for t in self.targets.values()}
        for name in [n for n in self._departed if n not in busy]:
            self._departed.discard(name)
            self.agent.remove_peer(name)

    def add_prefill(
        self,
        request_id: str,
        target: KVTarget,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        prompt: Optional[str] = None,
        multi_modal_data: Optional[dict] = None,
        resumed_tokens: int = 0,
    ) -> Sequence:
        """Admit a request whose KV goes to `target` (a CE's reservation). With images, the target
        is for the prompt with its placeholders expanded (what the router reserves).
        `resumed_tokens`: as `add_request`'s (a migrated sample's output so far, at the prompt's end).

        Raises:
            KVTargetRejected: the target's KV layout differs, its lease has expired, or it reserves
                room for another prompt length.
            InvalidRequestError: n > 1, or what `add_request` refuses.
        """
        params = params or SamplingParams()
        if target.fingerprint != self.layout.fingerprint:
            raise KVTargetRejected(
                f"KV layout mismatch for request {request_id!r}: the decode engine has "
                f"[{target.layout or target.fingerprint}], this prefill engine has [{self.layout.describe()}]"
            )
        if params.n != 1:
            raise InvalidRequestError("a prefill engine takes one sample per request (n=1); fan out n before prefill")
        if target.expires_at and time.time() > target.expires_at:
            raise KVTargetRejected(f"the KV reservation for {request_id!r} has expired")
        first = params.clone()
        first.max_tokens, first.min_tokens = 1, min(params.min_tokens, 1)
        inputs = {"multi_modal_data": multi_modal_data, "resumed_tokens": resumed_tokens}
        seq = self.add_request(request_id, prompt, first, prompt_token_ids, **inputs)
        needed = self.scheduler.block_manager.blocks_needed(len(seq))
        if len(target.block_ids) < needed or target.num_prompt_tokens != len(seq):
            self.abort_request(request_id)
            raise KVTargetRejected(
                f"KV target for {request_id!r} reserves {len(target.block_ids)} blocks for "
                f"{target.num_prompt_tokens} tokens; the prompt has {len(seq)} tokens ({needed} blocks)"
            )
        self.agent.add_peer(target.engine_id, target.agent_metadata)
        self.targets[request_id] = target
        return seq

    def renew_target(self, request_id: str, expires_at: float) -> bool:
        """The CE renewed the reservation of `request_id` until `expires_at` (wall clock): writes
        may be posted until then (never shortened). False when no prefill of it is here."""
        target = self.targets.get(request_id)
        if target is None:
            return False
        target.expires_at = max(target.expires_at, expires_at)
        return True

    def abort_request(self, request_id: str) -> None:
        """Wait out the request's chunk writes still in flight (they read its PE blocks and land
        in the CE's), then free and tell the CE its reserved blocks are free again."""
        self._deferred = [d for d in self._deferred if d[0].request_id != request_id]
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.wait_all(self.agent, self.transfer_timeout_s)
        super().abort_request(request_id)
        target = self.targets.pop(request_id, None)
        if target is not None:
            notice = HandoffNotice(request_id=request_id, ok=False, error="aborted")
            try:
                self.agent.send_notif(target.engine_id, notice.to_bytes())
            except Exception as e:  # the CE's lease and grace period release the blocks anyway
                logger.warning("could not notify %s of the abort of %s: %s", target.engine_id, request_id, e)

    # ---- hooks ----------------------------------------------------------------------------
    def post_schedule(self, out: SchedulerOutputs) -> None:
        self._handoff, self._chunks = [], []
        self._handoff_rows = []  # per hand-off: its last row in the step's hidden states
        self.num_computed_prompt_tokens += sum(out.num_new_tokens)
        for i, seq in enumerate(out.scheduled_seqs):
            if out.samples(i):
                self._handoff.append(seq)
                self._handoff_rows.append(sum(out.num_new_tokens[: i + 1]) - 1)
            elif envs.DEEPINFER_PD_STREAM_CHUNKS and seq.request_id in self.targets:
                self._chunks.append((seq, seq.num_cached_tokens + out.num_new_tokens[i]))

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        if not self._handoff and not self._chunks and not self._deferred:
            return
        bs = self.scheduler.block_manager.block_size
        # A chunk's blocks are posted one step later, once this step's forward is queued behind
        # that chunk's: waiting for the chunk's forward then keeps the device busy, where waiting
        # in its own step would idle it while the host builds the next chunk's inputs.
        deferred, self._deferred = self._deferred, []
        for seq, computed, forward_done in deferred:
            if seq.request_id not in self.targets:  # aborted meanwhile
                continue
            if forward_done is not None:
                forward_done.synchronize()
            stream = self._streams.setdefault(seq.request_id, PendingWrite(seq, self.targets[seq.request_id]))
            self._post(stream, computed // bs)  # only full blocks: the next chunk still writes the last one
        if self._handoff:
            self._post_handoffs()
        self._deferred = [(seq, computed, self.worker.runner.forward_event) for seq, computed in self._chunks]
        self._handoff, self._chunks = [], []

    def _post_handoffs(self) -> None:
        """Post the rest of each finished prompt's blocks. With layer groups, group g goes out as
        soon as the forward has written its layers' KV, while the later layers still compute.
        Every write's request is made first, while the forward still runs (its launches are
        asynchronous), so that only the posts remain on time-to-first-token."""
        bm = self.scheduler.block_manager
        pending = [
            self._streams.pop(s.request_id, None) or PendingWrite(s, self.targets[s.request_id]) for s in self._handoff
        ]
        upto = [bm.blocks_needed(len(p.seq)) for p in pending]
        hidden, self.worker.runner.last_hidden = self.worker.runner.last_hidden, None  # not kept past the step
        if self.sends_last_hidden and hidden is not None:
            for p, row in zip(pending, self._handoff_rows):
                p.last_hidden = hidden[row].clone()
        events = self.worker.runner.layer_events
        groups = (self._layer_groups if events is not None and len(events) == self.layout.num_layers else []) or [None]
        prepared = [[self._prepare(p, n, layers) for p, n in zip(pending, upto)] for layers in groups]
        try:
            for g, layers in enumerate(groups):
                if layers is None:
                    self.worker.runner.wait_forward()  # the WRITE reads KV the forward has just produced
                elif events[layers.stop - 1] is not None:
                    events[layers.stop - 1].synchronize()  # the KV of these layers is in the cache
                last = g == len(groups) - 1
                for p, n, write in zip(pending, upto, prepared[g]):
                    if last:  # the forward is done: from here on the hand-off adds to TTFT
                        p.last_post = time.monotonic()
                    self._submit(p, write, n, advance=last)
        finally:  # a failed forward leaves requests unposted: NIXL must not keep them
            for write in (w for group in prepared for w in group if w is not None):
                self.agent.discard(write)
        self._inflight.extend(pending)

    def _post(self, pending: PendingWrite, upto: int, layers: Optional[range] = None, advance: bool = True) -> None:
        """Post a WRITE of blocks [sent_blocks, upto) of the request's table (of `layers`, default
        all) into the same CE blocks; `advance`: those blocks are then sent (every layer group is)."""
        self._submit(pending, self._prepare(pending, upto, layers), upto, advance)

    def _prepare(self, pending: PendingWrite, upto: int, layers: Optional[range]) -> Optional[PreparedWrite]:
        """The request of `_post`'s WRITE, made but not posted; None when there is nothing to send
        or the request has failed (its error recorded)."""
        target = pending.target
        if pending.error is not None or upto <= pending.sent_blocks or pending.expired():
            return None
        first, blocks = pending.sent_blocks, pending.seq.block_table
        try:
            return self.agent.prepare_write(
                target.engine_id,
                blocks[first:upto],
                target.base_addr,
                target.num_blocks_total,
                target.block_ids[first:upto],
                target.device_id,
                target.mem_type,
                layers=layers,
            )
        except Exception as e:  # an unknown or vanished peer
            pending.error = str(e)
            return None

    def _submit(self, pending: PendingWrite, write: Optional[PreparedWrite], upto: int, advance: bool) -> None:
        if write is None:
            return
        if pending.error is not None or pending.expired():  # an earlier group failed, or the lease ran out
            self.agent.discard(write)
            return
        try:
            transfer = self.agent.post(write)
        except Exception as e:  # a dead peer can fail at post time
            pending.error = str(e)
            return
        pending.transfers.append(transfer)
        pending.sent_blocks = upto if advance else pending.sent_blocks
        pending.first_post = pending.first_post or transfer.started

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        for pending in self._inflight:
            if pending.transfers:
                pending.wait_all(self.agent, self.transfer_timeout_s)
                done = time.monotonic()
                pending.seconds, pending.exposed_seconds = done - pending.first_post, done - pending.last_post
            self._done.append(pending)
        self._inflight = []
        for stream in self._streams.values():  # chunk writes: release the ones that have landed
            still = []
            for transfer in stream.transfers:
                try:
                    if self.agent.reap(transfer):
                        stream.num_bytes += transfer.num_bytes
                    else:
                        still.append(transfer)
                except TransferError as e:
                    stream.error = stream.error or str(e)
            stream.transfers = still

    def send_processed_prompts(self) -> None:
        for pending in self._done:
            self._hand_off(pending)
        self._done = []

    def _hand_off(self, pending: PendingWrite) -> None:
        seq, target = pending.seq, pending.target
        ok = pending.error is None
        notice = HandoffNotice(
            request_id=seq.request_id,
            ok=ok,
            first_token=seq.output_token_ids[0] if ok else -1,
            num_computed_tokens=seq.num_prompt_tokens if ok else 0,
            first_logprob=seq.output_logprobs[0] if ok and seq.output_logprobs else None,
            first_top_logprobs=seq.output_top_logprobs[0] if ok and seq.output_top_logprobs else None,
            error=pending.error,
            num_cached_tokens=seq.num_prefix_hit_tokens if ok else 0,
            image_spans=image_spans(seq) if ok else None,
            last_hidden=encode_hidden(pending.last_hidden) if ok and pending.last_hidden is not None else None,
        )
        try:
            self.agent.send_notif(target.engine_id, notice.to_bytes())
        except Exception as e:
            if ok:
                ok, pending.error = False, f"notifying the decode engine failed: {e}"
        self.scheduler.remove_seq(seq)
        self.scheduler.free_seq(seq)  # ownership has moved to the CE (or the request failed)
        self.targets.pop(seq.request_id, None)
        self.requests.pop(seq.request_id, None)
        self.handoff_results.append(
            HandoffResult(
                seq.request_id,
                ok,
                notice.first_token,
                notice.num_computed_tokens,
                pending.num_bytes,
                pending.seconds,
                pending.exposed_seconds,
                pending.error,
            )
        )

    def poll_handoffs(self) -> list:
        """Drive the transfer plane between steps (a PE's notices must leave even while it idles);
        a PE has no outputs to report here, its hand-offs come from `pop_handoff_results`."""
        self.agent.progress()
        if self.kv_store is not None:
            self.kv_store.poll()
        if self._departed:
            self._release_departed()
        return []

    def pop_handoff_results(self) -> list[HandoffResult]:
        results, self.handoff_results = self.handoff_results, []
        return results

    def load(self) -> EngineLoad:
        load = super().load()
        load.requests += len(self._inflight) + len(self._done)  # handed off, not yet reported
        load.kv_transfer_bytes = self.agent.bytes_sent
        load.computed_prompt_tokens = self.num_computed_prompt_tokens
        load.transfer_peers = len(self.agent.peers)
        loading = self.scheduler.loading
        load.waiting_requests += len(loading)
        load.queued_prompt_tokens += sum(s.num_uncomputed_tokens for s in loading)
        if self.kv_store is not None:
            self.kv_store.stats().add_to(load)
        return load

    def kv_store_stats(self) -> Optional[KVStoreStats]:
        return self.kv_store.stats() if self.kv_store is not None else None

    def probe_prefix(
        self, prompt_token_ids: list[int], image_spans: Optional[list[tuple[int, int, int]]] = None
    ) -> PrefixProbe:
        """Prompt tokens this PE would take from its prefix cache and the store (for routing)."""
        return probe_prefix(self.scheduler.block_manager, self.kv_store, prompt_token_ids, image_spans)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._inflight or self._done)
