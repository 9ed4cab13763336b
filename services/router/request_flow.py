"""One sample of one request through the stages: the router's state machine.

Disaggregated: reserve on a CE (lease) -> prefill on a PE into that reservation (the first
token comes back here and goes straight to the client) -> stream the rest from the CE, which
starts after that token. A prefill that fails before any token was sent, in a way that may
succeed elsewhere, is retried on another PE with a fresh reservation; a request the engine
refuses as the client's fault (INVALID_ARGUMENT) never is. Colocated: one NORMAL engine
streams everything. Conditional disaggregation: a sample whose prompt a CE mostly holds already (or
is short) is first offered to that CE to prefill itself (`_local_prefill`). Every hop has a deadline; leaving early (client gone, error) aborts the
sub-request on the stage that holds it.
"""

from __future__ import annotations

import asyncio
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
from services.router.encode_step import EncodeStep
from services.router.prefix_index import chunk_hashes
from services.router.registry import WorkerHandle

_RETRIED_PREFILL = frozenset(
    {
        ErrorCode.UNAVAILABLE,  # the PE is gone or draining
        ErrorCode.RESOURCE_EXHAUSTED,  # the PE has no room now
        ErrorCode.FAILED_PRECONDITION,  # the PE refused the CE's target: a fresh reservation may do
        ErrorCode.INTERNAL,  # the KV transfer failed
    }
)
"""Prefill failures that may succeed on another PE (or CE); any other code ends the request."""
_BLAMES_THE_CE = (ErrorCode.INTERNAL, ErrorCode.FAILED_PRECONDITION)
"""The PE answered but the hand-off failed (transfer error, stale lease): the CE is suspect."""


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
        """What the sample may hold on a decode engine (prompt + every output token)."""
        self.prefix = [] if self.images else chunk_hashes(prompt)
        """The prompt's chunk hashes: which workers hold a prefix of it (prefix-aware routing). None for a
        prompt with images: its KV depends on the images, which equal placeholder tokens do not show."""

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"request {self.request_id} ran past its deadline")
        return left

    def deltas(self) -> AsyncIterator[SampleDelta]:
        if self.router.disaggregated():
            return self._disaggregated()
        return self._colocated()

    # ---- colocated -------------------------------------------------------------------------
    async def _colocated(self) -> AsyncIterator[SampleDelta]:
        sub_id = f"{self.request_id}/{self.index}"
        worker = await self._wait_for(
            POOL_COLOCATED, lambda ex: self.router.pick_decode(POOL_COLOCATED, self.kv_tokens, ex), set()
        )
        self._hold(worker, self.kv_tokens, "colocated")
        m.QUEUE_TIME.labels(self.router.model).observe(time.monotonic() - self.arrival)
        finished = False
        try:
            async for delta in worker.client.generate(sub_id, self.prompt, self.params, self.remaining(), self.images):
                finished = delta.finished
                yield delta
        finally:
            self._release(worker, self.kv_tokens)
            if not finished:
                self.router.abort_later(worker, sub_id, prefill=False)

    # ---- disaggregated ---------------------------------------------------------------------
    async def _disaggregated(self) -> AsyncIterator[SampleDelta]:
        # a CE encodes no images: a prompt with images is always prefilled on a PE
        local = await self._local_prefill() if self.config.pd.local_prefill_tokens and not self.images else None
        if local is not None:
            async for delta in local:
                yield delta
            return
        tried_pe: set[str] = set()
        suspect_ce: set[str] = set()
        last_error: Optional[ServiceError] = None
        encoder = EncodeStep(self) if self.images and self.router.encodes_images() else None
        lost_embeds = 0
        for attempt in range(self.config.max_prefill_attempts):
            sub_id = f"{self.request_id}/{self.index}/{attempt}"
            images = await encoder.encode(sub_id) if encoder is not None else self.images
            ce, kv_target = await self._reserve(sub_id, suspect_ce)
            try:
                first = await self._prefill(sub_id, kv_target, tried_pe, images)
            except _RetryPrefill as retry:
                last_error = retry.error
                lost = EMBEDDINGS_UNAVAILABLE in retry.error.message  # the encoder's lease, not the PE, failed
                lost_embeds += lost
                if lost_embeds > 1:  # the read failed after a fresh encode too: say so, never guess
                    self._failed(ce, sub_id, encoder, images)
                    raise ServiceError(ErrorCode.UNAVAILABLE, retry.error.message) from None
                if not lost:
                    (suspect_ce if retry.decode_side else tried_pe).add(retry.decode_side or retry.worker_id)
                self._failed(ce, sub_id, encoder, images)
                m.ROUTER_RETRIES.labels(retry.error.code.name).inc()
                continue
            except BaseException:
                self._failed(ce, sub_id, encoder, images)
                raise
            ce.prefixes.record(self.prefix)  # the CE's prefix cache holds the handed-off prompt too
            async for delta in self._decode(ce, sub_id, first.first):
                yield delta
            return
        raise ServiceError(
            ErrorCode.UNAVAILABLE,
            f"prefill failed {self.config.max_prefill_attempts} times; last error: "
            f"{last_error.message if last_error else '?'}",
        )

    def _failed(self, ce: WorkerHandle, sub_id: str, encoder: Optional[EncodeStep], images: list) -> None:
        """A prefill attempt failed: let go of its CE reservation and of its image leases (a
        retry encodes again: a lease the PE may have read is never read twice)."""
        self._release(ce, self.kv_tokens)
        self.router.abort_later(ce, sub_id, prefill=False)
        if encoder is not None:
            encoder.release(images)

    async def _local_prefill(self) -> Optional[AsyncIterator[SampleDelta]]:
        """Conditional disaggregation: the deltas of this sample prefilled on a CE itself, when the
        part of the prompt the CE is not believed to hold is short; None: take the P/D path (no CE
        with room now, or the CE, which decides against its own prefix cache, declined)."""
        ce = self.router.pick_decode(POOL_DECODE, self.kv_tokens, set())
        if (
            ce is None
            or len(self.prompt) - ce.prefixes.matched_tokens(self.prefix) > self.config.pd.local_prefill_tokens
        ):
            return None
        sub_id = f"{self.request_id}/{self.index}/local"
        self._hold(ce, self.kv_tokens, None)
        m.QUEUE_TIME.labels(self.router.model).observe(time.monotonic() - self.arrival)
        stream = ce.client.generate(sub_id, self.prompt, self.params, self.remaining())
        try:
            first = await stream.__anext__()
        except ServiceError as e:
            self._release(ce, self.kv_tokens)
            if e.code != ErrorCode.RESOURCE_EXHAUSTED:
                raise
            return None
        except BaseException:
            self._release(ce, self.kv_tokens)
            self.router.abort_later(ce, sub_id, prefill=False)
            raise
        m.ROUTER_DECISIONS.labels("local_prefill", ce.worker_id).inc()
        ce.prefixes.record(self.prefix)
        return self._local_stream(ce, sub_id, first, stream)

    async def _local_stream(
        self, ce: WorkerHandle, sub_id: str, first: SampleDelta, rest: AsyncIterator[SampleDelta]
    ) -> AsyncIterator[SampleDelta]:
        finished = first.finished
        try:
            yield first
            async for delta in rest:
                finished = delta.finished
                yield delta
        finally:
            self._release(ce, self.kv_tokens)
            await rest.aclose()
            if not finished:
                self.router.abort_later(ce, sub_id, prefill=False)

    async def _reserve(self, sub_id: str, avoid: set[str]) -> tuple[WorkerHandle, KVTarget]:
        """A reservation on a CE with room; CEs in `avoid` (suspected by a failed hand-off) only
        when no other CE is ready."""
        refused: set[str] = set()

        def pick(exclude: set[str]) -> Optional[WorkerHandle]:
            ce = self.router.pick_decode(POOL_DECODE, self.kv_tokens, exclude | avoid)
            return ce or self.router.pick_decode(POOL_DECODE, self.kv_tokens, exclude)

        while True:
            ce = await self._wait_for(POOL_DECODE, pick, refused)
            self._hold(ce, self.kv_tokens, None)
            timeout = min(self.config.reserve_timeout_s, self.remaining())
            try:
                target = await ce.client.reserve(sub_id, self.prompt, self.params, self.config.pd.lease_s, timeout)
            except ServiceError as e:
                self._release(ce, self.kv_tokens)
                if e.code not in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED):
                    raise
                refused.add(ce.worker_id)
                continue
            m.ROUTER_DECISIONS.labels("decode", ce.worker_id).inc()
            self._ce_id = ce.worker_id
            return ce, target

    async def _prefill(self, sub_id: str, kv_target: KVTarget, tried: set[str], images: list) -> PrefillResult:
        pe = await self._wait_for(
            POOL_PREFILL, lambda ex: self.router.pick_prefill(len(self.prompt), ex, self.prefix), tried, strict=True
        )
        self._hold(pe, len(self.prompt), "prefill")
        timeout = min(self.config.pd.prefill_timeout_s, self.remaining())
        try:
            result = await pe.client.prefill(sub_id, self.prompt, self.params, kv_target, timeout, images)
        except ServiceError as e:
            self.router.abort_later(pe, sub_id, prefill=True)
            if e.code not in _RETRIED_PREFILL:
                raise
            embeds_lost = EMBEDDINGS_UNAVAILABLE in e.message  # the encoder's side, not the CE's
            decode_side = self._ce_id if e.code in _BLAMES_THE_CE and not embeds_lost else ""
            raise _RetryPrefill(e, pe.worker_id, decode_side) from None
        except asyncio.CancelledError:
            self.router.abort_later(pe, sub_id, prefill=True)
            raise
        finally:
            self._release(pe, len(self.prompt))
        m.QUEUE_TIME.labels(self.router.model).observe(result.queue_seconds + (self._dispatched - self.arrival))
        m.KV_TRANSFER_SECONDS.labels(pe.worker_id).observe(result.kv_seconds)
        m.KV_HANDOFF_EXPOSED_SECONDS.labels(pe.worker_id).observe(result.kv_exposed_seconds)
        m.KV_TRANSFER_BYTES.labels(pe.worker_id).inc(result.kv_bytes)
        if result.embeds_seconds:
            m.EMBEDDING_TRANSFER_SECONDS.labels(pe.worker_id).observe(result.embeds_seconds)
        pe.prefixes.record(self.prefix)
        return result

    async def _decode(self, ce: WorkerHandle, sub_id: str, first: SampleDelta) -> AsyncIterator[SampleDelta]:
        finished = False
        try:
            yield first
            async for delta in ce.client.stream(sub_id, self.remaining()):
                finished = delta.finished
                yield delta
        finally:
            self._release(ce, self.kv_tokens)
            if not finished:
                self.router.abort_later(ce, sub_id, prefill=False)

    # ---- picking and accounting --------------------------------------------------------------
    async def _wait_for(
        self, pool: int, pick: Callable[[set[str]], Optional[WorkerHandle]], exclude: set[str], strict: bool = False
    ) -> WorkerHandle:
        """A worker from `pick`, waiting for one to join or free up until the admission deadline.
        `exclude` is retried after a pause unless `strict` (workers that already failed us)."""
        give_up = min(self.deadline, time.monotonic() + self.config.admission_timeout_s)
        while True:
            worker = pick(exclude)
            if worker is not None:
                self._dispatched = time.monotonic()
                return worker
            ready = {h.worker_id for h in self.router.registry.pool(pool)}
            if strict and ready and ready <= exclude:
                raise ServiceError(ErrorCode.UNAVAILABLE, f"every {POOL_NAMES[pool]} worker failed this request")
            if time.monotonic() >= give_up:
                raise self.router.no_capacity_error(pool)
            await self.router.registry.wait_changed(min(0.05, max(0.001, give_up - time.monotonic())))
            if not strict:
                exclude.clear()

    def _hold(self, worker: WorkerHandle, tokens: int, pool_label: Optional[str]) -> None:
        worker.inflight += 1
        worker.inflight_tokens += tokens
        if pool_label:
            m.ROUTER_DECISIONS.labels(pool_label, worker.worker_id).inc()

    def _release(self, worker: WorkerHandle, tokens: int) -> None:
        worker.inflight -= 1
        worker.inflight_tokens -= tokens
        self.router.registry.released(worker)


class _RetryPrefill(Exception):
    def __init__(self, error: ServiceError, worker_id: str, decode_side: str):
        super().__init__(error.message)
        self.error = error
        self.worker_id = worker_id
        """The PE that failed."""
        self.decode_side = decode_side
        """The CE to blame instead of the PE ("" = the PE's fault)."""
