"""The prefill worker (PE): prefill into a CE's reservation, answer with the first token.

`prefill()` resolves when the hand-off is done: the KV is in the CE's blocks and the CE has
been told (first token, computed length). The first token's text and logprobs come from the
PE's own step output, which precedes the hand-off result in the same engine turn.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Optional

from deepinfer_core.errors import EngineError
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVRegion, KVTarget
from services.common.deltas import OutputDiffer
from services.common.errors import ErrorCode, ServiceError, engine_error, refused_output_error
from services.common.prefill_result import PrefillResult
from services.common.workers import WorkerLoad
from services.workers.base_core import WorkerCore
from services.workers.embedding_fetcher import EmbeddingFetcher


@dataclass
class _Pending:
    future: asyncio.Future
    admitted_at: float
    queue_seconds: Optional[float] = None
    last: Optional[RequestOutput] = None
    embeds_seconds: float = 0.0


class PrefillCore(WorkerCore):
    def __init__(self, engine, worker_id: str = "", loop=None):
        super().__init__(engine, worker_id, loop)
        self.pending: dict[str, _Pending] = {}
        self.num_handoffs = 0
        self.num_failed_handoffs = 0
        self.kv_bytes = 0
        self.embeddings: Optional[EmbeddingFetcher] = None
        """Reads image embeddings from vision encoders (made at the first request with any)."""
        self._aborted: dict[str, float] = {}
        """Ids aborted lately (-> when): a Prefill for one arriving late is refused, so an answered
        Abort means this engine will never write into that request's reservation."""

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_target: KVTarget,
        images=(),
        resumed_tokens: int = 0,
    ) -> PrefillResult:
        """`images`: one per image of the prompt, its encoded file or its `EmbeddingHandle`.
        `resumed_tokens`: the prompt's tail that is a migrated sample's output so far."""
        self.check_accepting()
        if request_id in self._aborted:
            raise ServiceError(ErrorCode.CANCELLED, f"request {request_id!r} was aborted before it arrived")
        if request_id in self.pending:  # refused before the first one's record is touched
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use on worker {self.worker_id}"
            )
        mm, embeds_seconds = await self._image_data(images)
        pending = _Pending(self.loop.create_future(), time.monotonic(), embeds_seconds=embeds_seconds)
        self.pending[request_id] = pending
        try:
            first = first_token_params(params)
            await self.host.run(_admit, request_id, kv_target, first, prompt_token_ids, mm, resumed_tokens)
            return await pending.future
        except EngineError as e:
            self.pending.pop(request_id, None)
            raise engine_error(e) from None
        except asyncio.CancelledError:  # the admission may still run: the abort is queued after it
            if self.pending.pop(request_id, None) is not None:
                await asyncio.shield(self.abort(request_id))
            raise

    async def _image_data(self, images) -> tuple[Optional[dict], float]:
        """(the engine's `multi_modal_data`, seconds reading embeddings): encoded files as they
        are, or the embeddings a vision encoder parked, read over NIXL (a failed read raises)."""
        if not images:
            return None, 0.0
        if all(isinstance(i, (bytes, bytearray)) for i in images):
            return {"image": list(images)}, 0.0
        if self.embeddings is None:
            self.embeddings = EmbeddingFetcher(self.worker_id)
        embeds, seconds = await self.embeddings.read(images)
        return {"image_embeds": embeds, "image_hashes": [h.content_hash for h in images]}, seconds

    async def connect_peer(self, agent_name: str, metadata: bytes, region: Optional[KVRegion] = None) -> None:
        """Connect to a CE and, given its KV `region`, prepare its transfer descriptors now."""
        try:
            await self.host.run(lambda engine: engine.connect_peer(agent_name, metadata, region))
        except EngineError as e:  # a CE whose KV layout differs from ours
            raise engine_error(e) from None

    async def abort(self, request_id: str) -> bool:
        """End the request; once this returns, no write of it is in flight or will be posted."""
        now = time.monotonic()
        self._aborted[request_id] = now
        if len(self._aborted) > _TOMBSTONES:  # oldest first (insertion order): keep the recent ones
            for rid in list(self._aborted)[: len(self._aborted) - _TOMBSTONES]:
                del self._aborted[rid]
        return await super().abort(request_id)

    async def renew_lease(self, request_id: str, expires_at: float) -> bool:
        """The CE renewed the request's reservation until `expires_at`: its writes may be posted
        until then. False when no prefill of it is here."""
        if not self.host.alive:
            return False
        return await self.host.run(lambda engine: engine.renew_target(request_id, expires_at))

    async def disconnect_peer(self, agent_name: str) -> None:
        """Forget a CE that left (its agent goes once no hand-off targets it)."""
        if self.host.alive:
            await self.host.run(lambda engine: engine.disconnect_peer(agent_name))

    def _forget(self, request_id: str) -> bool:
        pending = self.pending.pop(request_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(ServiceError(ErrorCode.CANCELLED, f"request {request_id!r} was aborted"))
        return pending is not None

    def _on_turn(self, outputs: list, handoff_results: list) -> None:
        for out in outputs:
            self._on_output(out)
        for r in handoff_results:
            self._on_handoff(r)

    def _on_output(self, out: RequestOutput) -> None:
        pending = self.pending.get(out.request_id)
        if pending is None:
            return
        if pending.queue_seconds is None:
            pending.queue_seconds = max(0.0, self.host.step_started_at - pending.admitted_at)
        pending.last = out
        sample = out.outputs[0]
        if sample.finish_reason in ("error", "abort", "preempted") and not sample.token_ids:
            self._resolve(out.request_id, refused_output_error(sample.finish_reason, sample.error))

    def _on_handoff(self, r) -> None:
        pending = self.pending.get(r.request_id)
        if r.ok:
            self.num_handoffs += 1
            self.kv_bytes += r.num_bytes
        else:
            self.num_failed_handoffs += 1
        if pending is None:
            return
        if not r.ok or pending.last is None:
            self._resolve(r.request_id, ServiceError(ErrorCode.INTERNAL, f"KV hand-off failed: {r.error}"))
            return
        first = OutputDiffer().diff(pending.last.outputs[0], pending.last.num_cached_tokens)
        first.finish_reason = first.stop_reason = None
        result = PrefillResult(
            first, r.num_bytes, r.seconds, pending.queue_seconds or 0.0, r.exposed_seconds, pending.embeds_seconds
        )
        self._resolve(r.request_id, result)

    def _resolve(self, request_id: str, value) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is None or pending.future.done():
            return
        if isinstance(value, Exception):
            pending.future.set_exception(value)
        else:
            pending.future.set_result(value)

    def stats(self) -> WorkerLoad:
        load = super().stats()
        load.handoffs = self.num_handoffs
        return load


_TOMBSTONES = 65536
"""Aborted ids remembered: far more than can be in flight to one engine at once."""


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's parameters as the PE applies them to its one token.

    The CE's stream starts after the first token with the text the CE has for it, so the PE
    must end that token's text where the CE does. A request with min_tokens > 1 ignores stop
    strings at its first token on the CE; the PE, which generates one token, would apply them
    (and cut the text short), so it gets none. Stop token ids need no care: below min_tokens
    the sampler never draws them."""
    if params.min_tokens <= 1 or not params.stop:
        return params
    first = params.clone()
    first.stop = []
    return first


def _admit(engine, request_id, kv_target, params, prompt_token_ids, multi_modal_data, resumed_tokens):
    engine.add_prefill(
        request_id,
        kv_target,
        params,
        prompt_token_ids,
        multi_modal_data=multi_modal_data,
        resumed_tokens=resumed_tokens,
    )
