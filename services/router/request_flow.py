"""One sample of one request through the stages: the router's state machine.

Disaggregated: reserve on a CE (a short lease, renewed while the prefill runs) -> prefill on a PE into that reservation (the first
token comes back here and goes straight to the client) -> stream the rest from the CE, which
starts after that token. A prefill that fails before any token was sent, in a way that may
succeed elsewhere, is retried on another PE with a fresh reservation; a request the engine
refuses as the client's fault (INVALID_ARGUMENT) never is. Images go to a vision encoder first
(`encode_step.py`) and the PE reads their embeddings. Conditional disaggregation: a sample whose
prompt a CE mostly holds already (or is short) is first offered to that CE to prefill itself
(`local_prefill.py`). Colocated: one NORMAL engine streams everything. Every hop has a deadline; leaving early (client gone, error) aborts the
sub-request on the stage that holds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Optional

from deepinfer_core.multimodal.embedding_handle import EMBEDDINGS_UNAVAILABLE
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVTarget
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.prefill_result import PrefillResult
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_NAMES, POOL_PREFILL
from services.metrics import definitions as m
from services.router.decode_policy import blocks_for
from services.router.encode_step import EncodeStep
from services.router.lease_keeper import LeaseKeeper, target_renewer
from services.router.local_prefill import local_prefill
from services.router.migration import SampleProgress, StreamBroken
from services.router.prefill_retry import BLAMES_THE_CE, RETRIED_PREFILL, RetryPrefill, excluded_after
from services.router.prefix_index import chunk_hashes
from services.router.registry import WorkerHandle

logger = logging.getLogger(__name__)

_UNCERTAIN = (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.CANCELLED)
"""A call that failed this way may have done its work on the worker: undo it (a refusal did nothing)."""


class SampleFlow:
    def __init__(
        self,
        router,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        deadline: float,
        images: Sequence[bytes] = (),
    ):
        self.router = router
        self.images = list(images)
        """Encoded files, one per image of the prompt (the engine encodes them, or a vision encoder does first)."""
        self.config = router.config
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.params = params
        self.deadline = deadline
        self.arrival = time.monotonic()
        max_out = params.max_tokens or max(1, router.max_model_len - len(prompt))
        self.kv_tokens = len(prompt) + max_out
        """What the sample may hold on a decode engine (prompt + every output token); a migrated
        sample's continuation holds the same (longer prompt, fewer tokens to go)."""
        self.progress = SampleProgress(prompt, params)
        self.migrations = 0
        self.suspects: set[str] = set()
        """Streaming workers whose stream of this sample broke: a migration goes elsewhere if it can."""
        self._handed_out = False
        """The current attempt's KV target has gone to a PE (`_pe`): it may write into the reservation."""
        self._pe: Optional[WorkerHandle] = None
        self.lane = None
        """The request's fast lane (`services/common/fast_lane.py`) when this is its one sample."""
        self.prefix: list[int] = []
        """The current attempt's prompt as chunk hashes: which workers hold a prefix of it (prefix-aware
        routing). None for a prompt with images: its KV depends on the images, which equal placeholder
        tokens do not show."""

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"request {self.request_id} ran past its deadline")
        return left

    async def deltas(self) -> AsyncIterator[SampleDelta]:
        """The sample's deltas; a decode stream that breaks mid-request moves the sample to a healthy
        engine (up to `migration_limit` times), the client's stream going on where it was."""
        run = self._disaggregated if self.router.disaggregated() else self._colocated
        last: Optional[StreamBroken] = None
        while True:
            prompt, params = self.progress.continuation()
            attempt = run(prompt, params)
            try:
                async for delta in attempt:
                    yield self.progress.place(delta)
                return
            except ServiceError as e:
                if last is None or e.code != ErrorCode.INVALID_ARGUMENT:
                    raise
                # the continuation, not the request, was refused (its output so far holds a token the
                # engine takes only with an input of its own, such as an image placeholder)
                raise ServiceError(ErrorCode.UNAVAILABLE, f"{last.message}; it could not move: {e.message}") from None
            except StreamBroken as broken:
                if self.migrations >= self.config.migration_limit:
                    raise broken.as_error(self.migrations) from None
                last = broken
                self.migrations += 1
                m.MIGRATIONS.labels(broken.reason).inc()
                logger.warning(
                    "request %s sample %d: %s; migrating (%d) with %d token(s) so far",
                    self.request_id,
                    self.index,
                    broken.message,
                    self.migrations,
                    self.progress.num_tokens,
                )
            finally:
                await attempt.aclose()

    def resumed_tokens(self, prompt: list[int]) -> int:
        """How many of an attempt's prompt tokens are the sample's output so far (0 but after a
        migration): the engine takes them as plain tokens, whatever ids the model generated."""
        return len(prompt) - len(self.prompt)

    def _sub_id(self, *parts: int) -> str:
        """The sub-request's id on a worker; a migrated sample's attempts are told apart."""
        tail = "".join(f"/{p}" for p in parts)
        return f"{self.request_id}/{self.index}{tail}" + (f"~m{self.migrations}" if self.migrations else "")

    # ---- colocated -------------------------------------------------------------------------
    async def _colocated(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[SampleDelta]:
        sub_id = self._sub_id()

        def pick(exclude: set[str]) -> Optional[WorkerHandle]:
            worker = self.router.pick_decode(POOL_COLOCATED, self.kv_tokens, exclude | self.suspects)
            return worker or self.router.pick_decode(POOL_COLOCATED, self.kv_tokens, exclude)

        worker = await self._wait_for(POOL_COLOCATED, pick, set())
        self._hold(worker, self.kv_tokens, "colocated")
        m.labelled(m.QUEUE_TIME, self.router.model).observe(time.monotonic() - self.arrival)
        try:
            stream = worker.client.generate(
                sub_id, prompt, params, self.remaining(), self.images, resumed_tokens=self.resumed_tokens(prompt)
            )
            relay = self._until_broken(worker, sub_id, stream)
        except BaseException:
            self._release(worker, self.kv_tokens)
            raise
        try:
            async for delta in relay:
                yield delta
        finally:
            await relay.aclose()
            self._release(worker, self.kv_tokens)

    # ---- disaggregated ---------------------------------------------------------------------
    async def _disaggregated(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[SampleDelta]:
        self.prefix = [] if self.images else chunk_hashes(prompt)
        # a CE encodes no images: a prompt with images is always prefilled on a PE
        local = (
            await local_prefill(self, prompt, params)
            if self.config.pd.local_prefill_tokens and not self.images
            else None
        )
        if local is not None:
            try:
                async for delta in local:
                    yield delta
            finally:
                await local.aclose()
            return
        tried_pe: set[str] = set()
        suspect_ce = self.suspects  # a CE whose stream broke, or whose hand-off failed
        last_error: Optional[ServiceError] = None
        encoder = EncodeStep(self) if self.images and self.router.encodes_images() else None
        lost_embeds = 0
        for attempt in range(self.config.max_prefill_attempts):
            sub_id = self._sub_id(attempt)
            self._handed_out = False
            images = await encoder.encode(sub_id) if encoder is not None else self.images
            try:
                ce, kv_target = await self._reserve(sub_id, prompt, params, suspect_ce)
            except BaseException:  # no CE (in time), or cancelled while waiting: no PE will read them
                if encoder is not None:
                    encoder.release(images)
                raise
            lease = LeaseKeeper(ce, sub_id, self.config.pd.renewed_lease_s, target_renewer(kv_target), self._writer)
            try:
                try:
                    first = await self._prefill(sub_id, prompt, params, kv_target, tried_pe, images)
                finally:
                    lease.stop()
                    if encoder is not None:
                        encoder.settled()
            except RetryPrefill as retry:
                last_error = retry.error
                self._failed(ce, sub_id, encoder, images)
                lost_embeds += excluded_after(retry, lost_embeds, tried_pe, suspect_ce)
                continue
            except BaseException:
                self._failed(ce, sub_id, encoder, images)
                raise
            ce.prefixes.record(self.prefix)  # the CE's prefix cache holds the handed-off prompt too
            decode = self._decode(ce, sub_id, first.first)
            try:
                async for delta in decode:
                    yield delta
            finally:
                await decode.aclose()  # its clean-up now, not whenever the generator is collected
            return
        raise ServiceError(
            ErrorCode.UNAVAILABLE,
            f"prefill failed {self.config.max_prefill_attempts} times; last error: "
            f"{last_error.message if last_error else '?'}",
        )

    def _writer(self) -> Optional[WorkerHandle]:
        """The PE the current attempt's KV target has gone to (None: not yet)."""
        return self._pe if self._handed_out else None

    def _failed(self, ce: WorkerHandle, sub_id: str, encoder: Optional[EncodeStep], images: list) -> None:
        """A prefill attempt failed: let go of its CE reservation and of its image leases (a retry
        encodes again: a lease the PE may have read is never read twice)."""
        self._release(ce, self.kv_tokens)
        self._end_reservation(ce, sub_id)
        if encoder is not None:
            encoder.release(images)

    def _end_reservation(self, ce: WorkerHandle, sub_id: str) -> None:
        """The reservation will not be used: give it back without a PE's write ever landing in blocks
        handed to another request (fenced on the CE unless the PE is known to be done with it)."""
        if self._handed_out and self._pe is not None:
            self.router.release_handed_out(self._pe, ce, sub_id)
        else:
            self.router.abort_later(ce, sub_id, prefill=False, unused=True)

    async def _reserve(
        self, sub_id: str, prompt: list[int], params: SamplingParams, avoid: set[str]
    ) -> tuple[WorkerHandle, KVTarget]:
        """A reservation on a CE with room; CEs in `avoid` (suspected by a failed hand-off) only
        when no other CE is ready."""
        refused: set[str] = set()

        def pick(exclude: set[str]) -> Optional[WorkerHandle]:
            ce = self.router.pick_decode(POOL_DECODE, self.kv_tokens, exclude | avoid)
            return ce or self.router.pick_decode(POOL_DECODE, self.kv_tokens, exclude)

        while True:
            ce = await self._wait_for(POOL_DECODE, pick, refused)
            timeout = min(self.config.reserve_timeout_s, self.remaining())
            self._hold(ce, self.kv_tokens, None)
            try:
                target = await ce.client.reserve(sub_id, prompt, params, self.config.pd.renewed_lease_s, timeout)
            except ServiceError as e:
                self._release(ce, self.kv_tokens)
                if e.code in _UNCERTAIN:  # it may have reserved before the call failed
                    self.router.abort_later(ce, sub_id, prefill=False, unused=True)
                if e.code not in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED):
                    raise
                if e.code == ErrorCode.UNAVAILABLE:
                    self.router.suspect(ce)
                refused.add(ce.worker_id)
                continue
            except BaseException:  # cancelled (the client left) while the CE was reserving
                self._release(ce, self.kv_tokens)
                self.router.abort_later(ce, sub_id, prefill=False, unused=True)
                raise
            m.labelled(m.ROUTER_DECISIONS, "decode", ce.worker_id).inc()
            self._ce_id = ce.worker_id
            return ce, target

    async def _prefill(
        self, sub_id: str, prompt: list[int], params: SamplingParams, kv_target: KVTarget, tried: set[str], images
    ) -> PrefillResult:
        pe = await self._wait_for(
            POOL_PREFILL, lambda ex: self.router.pick_prefill(len(prompt), ex, self.prefix), tried, strict=True
        )
        timeout = min(self.config.pd.prefill_timeout_s, self.remaining())
        self._hold(pe, len(prompt), "prefill")
        self._handed_out, self._pe = True, pe  # from here the PE may write into the reservation
        try:
            resumed = self.resumed_tokens(prompt)
            result = await pe.client.prefill(sub_id, prompt, params, kv_target, timeout, images, resumed_tokens=resumed)
        except ServiceError as e:  # `_end_reservation` aborts it on the PE (then the CE)
            if e.code not in RETRIED_PREFILL:
                raise
            if e.code == ErrorCode.UNAVAILABLE:
                self.router.suspect(pe)
            embeds_lost = EMBEDDINGS_UNAVAILABLE in e.message  # the encoder's side, not the CE's
            decode_side = self._ce_id if e.code in BLAMES_THE_CE and not embeds_lost else ""
            raise RetryPrefill(e, pe.worker_id, decode_side) from None
        finally:
            self._release(pe, len(prompt))
        m.labelled(m.QUEUE_TIME, self.router.model).observe(result.queue_seconds + (self._dispatched - self.arrival))
        m.labelled(m.KV_TRANSFER_SECONDS, pe.worker_id).observe(result.kv_seconds)
        m.labelled(m.KV_HANDOFF_EXPOSED_SECONDS, pe.worker_id).observe(result.kv_exposed_seconds)
        m.labelled(m.KV_TRANSFER_BYTES, pe.worker_id).inc(result.kv_bytes)
        if result.embeds_seconds:
            m.EMBEDDING_TRANSFER_SECONDS.labels(pe.worker_id).observe(result.embeds_seconds)
        pe.prefixes.record(self.prefix)
        return result

    async def _decode(self, ce: WorkerHandle, sub_id: str, first: SampleDelta) -> AsyncIterator[SampleDelta]:
        relay = None
        try:
            yield first
            relay = self._until_broken(ce, sub_id, ce.client.stream(sub_id, self.remaining()))
            async for delta in relay:
                yield delta
        finally:
            if relay is not None:
                await relay.aclose()  # its clean-up now, not whenever the generator is collected
            else:  # left (or ran out of time) before the CE's stream was read
                self.router.abort_later(ce, sub_id, prefill=False)
            self._release(ce, self.kv_tokens)

    async def _until_broken(self, worker: WorkerHandle, sub_id: str, stream) -> AsyncIterator[SampleDelta]:
        """A streaming worker's deltas until the sample finishes; raises StreamBroken when the
        worker fails it (after passing on the tokens it still sent). Leaving early aborts it there."""
        finished = False
        lane, inbox = self.lane, None
        try:
            async for delta in stream:
                broken = StreamBroken.from_delta(delta)
                if broken is not None:
                    self.suspects.add(worker.worker_id)
                    rest = self.progress.strip_failure(delta)
                    if rest is not None:
                        yield rest
                    raise broken
                finished = delta.finished
                yield delta
                if lane is not None:  # past the first delta: the stream's inbox is open, the client served
                    inbox = lane.attach(worker.client, sub_id)
                    lane = None
        except ServiceError as e:
            broken = StreamBroken.from_error(e)
            if broken is None:
                raise
            self.router.suspect(worker)
            self.suspects.add(worker.worker_id)
            raise broken from None
        finally:
            if inbox is not None:
                self.lane.detach(inbox)
            await stream.aclose()
            if not finished:
                self.router.abort_later(worker, sub_id, prefill=False)

    # ---- picking and accounting --------------------------------------------------------------
    async def _wait_for(
        self, pool: int, pick: Callable[[set[str]], Optional[WorkerHandle]], exclude: set[str], strict: bool = False
    ) -> WorkerHandle:
        """A worker from `pick`, waiting for one to join or free up until the admission deadline.
        `exclude` is retried after a pause unless `strict` (workers that already failed us)."""
        give_up = min(self.deadline, time.monotonic() + self.config.admission_timeout_s)
        all_failed_since: Optional[float] = None
        while True:
            worker = pick(exclude)
            if worker is not None:
                self._dispatched = time.monotonic()
                return worker
            ready = {h.worker_id for h in self.router.registry.pool(pool)}
            if strict and ready and ready <= exclude:
                # the ones that failed may be dead and about to leave (their replacements to join):
                # wait a little for that before blaming the request
                all_failed_since = all_failed_since or time.monotonic()
                if time.monotonic() - all_failed_since > self.config.failed_pool_grace_s:
                    raise ServiceError(
                        ErrorCode.UNAVAILABLE,
                        f"every {POOL_NAMES[pool]} worker failed this request",
                        retry_after_s=self.config.retry_after_s,  # replacements start within seconds
                    )
            else:
                all_failed_since = None
            if time.monotonic() >= give_up:
                raise self.router.no_capacity_error(pool)
            await self.router.registry.wait_changed(min(0.05, max(0.001, give_up - time.monotonic())))
            if not strict:
                exclude.clear()

    def _hold(self, worker: WorkerHandle, tokens: int, pool_label: Optional[str]) -> None:
        worker.inflight += 1
        worker.inflight_tokens += tokens
        worker.inflight_blocks += blocks_for(tokens, worker.info.block_size)
        if pool_label:
            m.labelled(m.ROUTER_DECISIONS, pool_label, worker.worker_id).inc()

    def _release(self, worker: WorkerHandle, tokens: int) -> None:
        worker.inflight -= 1
        worker.inflight_tokens -= tokens
        worker.inflight_blocks -= blocks_for(tokens, worker.info.block_size)
        self.router.registry.released(worker)
