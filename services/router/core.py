"""RouterCore: validates a request, fans out its samples, runs each through the stages and
merges what the client may see. Plain Python over `WorkerClient`s: tests drive it without gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleAssembler, SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.fast_lane import FastLane
from services.common.stream_merge import merge
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_ENCODER, POOL_NAMES, POOL_PREFILL
from services.metrics import definitions as m
from services.router.config import RouterConfig
from services.router.decode_policy import DecodeCandidate, DecodePolicy
from services.router.fanout import split_samples
from services.router.prefill_policy import PrefillCandidate, PrefillPolicy
from services.router.registry import PoolRegistry, WorkerHandle
from services.router.request_flow import SampleFlow

logger = logging.getLogger(__name__)


class RouterCore:
    def __init__(self, registry: PoolRegistry, config: RouterConfig = RouterConfig(), model: str = ""):
        self.registry = registry
        self.config = config
        self.model = model
        self.prefill_policy = PrefillPolicy(config.prefill_buckets)
        self.decode_policy = DecodePolicy()
        self.notes: dict[str, str] = {}
        """What the controller reports about the pools (an engine waiting for a node), by topic;
        added to the readiness detail."""
        self._background: set[asyncio.Task] = set()
        """Calls nobody waits for (aborts, probes); a task removes itself when done."""
        self._active: set[str] = set()
        """Ids of the requests streaming now: a second request under one of them gets a unique one."""
        self._renames = itertools.count(1)
        self._poller: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._poller = asyncio.ensure_future(self.registry.run_polling(self.config.poll_interval_s))

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.registry.close()

    # ---- requests --------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        timeout_s: float = 0.0,
        images=(),
        lane: Optional[FastLane] = None,
    ) -> AsyncIterator[SampleDelta]:
        """Deltas of every sample as the client may see them (stop strings held back until
        settled). Raises ServiceError; leaving early aborts the request everywhere. `images`:
        encoded files, one per image placeholder run of `prompt` (expanded). `lane`: the caller's
        fast lane, which takes ordinary mid-stream deltas of a one-sample request past this stream."""
        self._validate(prompt, params)
        request_id = self._claim(request_id)
        try:
            limit = self.config.limits.request_timeout_s
            deadline = time.monotonic() + min(timeout_s or limit, limit)
            holdback = max((len(s) for s in params.stop), default=1) - 1
            samples = split_samples(params)
            assemblers = [SampleAssembler(i, holdback) for i in range(len(samples))]
            flows = [SampleFlow(self, request_id, i, prompt, p, deadline, images) for i, p in enumerate(samples)]
            many = len(flows) > 1  # one sample (n = 1) is read directly, without the merge's tasks and queue
            if lane is not None and not many:
                flows[0].lane = lane
                lane.route = _route(flows[0].progress, assemblers[0])
                lane.progress, lane.assembler = flows[0].progress, assemblers[0]
            stream = merge([f.deltas() for f in flows]) if many else flows[0].deltas()
            try:
                async for item in stream:
                    index, delta = item if many else (0, item)
                    out = assemblers[index].push(delta)
                    if out is not None:
                        yield out
            finally:
                await stream.aclose()
        finally:
            self._active.discard(request_id)
        unfinished = [a.index for a in assemblers if not a.done]
        if unfinished:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"the output of sample(s) {unfinished} ended early")

    def _claim(self, request_id: str) -> str:
        """The request's id on the workers: its own, or, while another request streams under it
        (a client reused one), a unique one, so that neither request disturbs the other."""
        while request_id in self._active:
            request_id = f"{request_id.split('~dup', 1)[0]}~dup{next(self._renames)}"
        self._active.add(request_id)
        return request_id

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty", "prompt")
        max_n = self.config.limits.max_n
        if params.n > max_n:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"n must be <= {max_n}, got {params.n}", "n")
        limit = self.max_model_len
        if limit and len(prompt) >= limit:
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT,
                f"the prompt has {len(prompt)} tokens; the model's context length is {limit}",
                "prompt",
            )

    @property
    def max_model_len(self) -> int:
        lens = [h.info.max_model_len for h in self.registry.workers.values() if h.info.max_model_len]
        return min(lens) if lens else 0

    def disaggregated(self) -> bool:
        """P/D unless the router serves the colocated pool (configured, or the only one present)."""
        if self.config.pools:
            return POOL_COLOCATED not in self.config.pools
        has = {h.info.pool for h in self.registry.workers.values()}
        return (POOL_PREFILL in has and POOL_DECODE in has) or POOL_COLOCATED not in has

    def abort_later(self, worker: WorkerHandle, sub_id: str, prefill: bool, unused: bool = False) -> None:
        """Abort a sub-request without waiting (the caller may be cancelled itself); `unused`: a CE
        reservation whose KV target no PE was given, so its blocks need no quarantine."""
        self.run_later(
            worker.client.abort(sub_id, prefill, unused=True) if unused else worker.client.abort(sub_id, prefill)
        )

    def release_handed_out(self, pe: WorkerHandle, ce: WorkerHandle, sub_id: str) -> None:
        """A sub-request whose KV target a PE was given ends early: abort it on the PE first, then
        on the CE. A PE that answered the abort will never write for it (it waits out writes in
        flight and refuses the id from then on), so the CE frees the blocks at once; a PE that could
        not be reached may still write, so the CE fences them (quarantine) until the lease is over,
        or until the PE is declared dead (its process is gone: no write can come), whichever is first."""
        self.run_later(self._release_handed_out(pe, ce, sub_id))

    async def _release_handed_out(self, pe: WorkerHandle, ce: WorkerHandle, sub_id: str) -> None:
        try:
            reached = await pe.client.abort(sub_id, True)
        except (asyncio.CancelledError, Exception):  # its channel closed under the call (the PE left)
            reached = None
        if reached is not None:
            await ce.client.abort(sub_id, False, unused=True)
            return
        await ce.client.abort(sub_id, False)  # the request ends now, its blocks fenced
        if await self.registry.wait_dead(pe, self.config.writer_death_wait_s):
            await ce.client.abort(sub_id, False, unused=True)
            m.FENCES_LIFTED.inc()

    def run_later(self, coro) -> None:
        """Run a clean-up call without waiting for it (kept until done; `stop` waits for it)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_done_in_background)

    def encodes_images(self) -> bool:
        """Whether images go to a vision encoder first (an encoder pool is configured or present)."""
        if self.config.pools:
            return POOL_ENCODER in self.config.pools
        return bool(self.registry.pool(POOL_ENCODER, ready_only=False))

    # ---- policies ----------------------------------------------------------------------------
    def pick_prefill(self, prompt_len: int, exclude: set[str], prefix: Sequence[int] = ()) -> Optional[WorkerHandle]:
        """`prefix`: the prompt's chunk hashes (`prefix_index.chunk_hashes`), for prefix-aware choice."""
        pool = {h.worker_id: h for h in self.registry.pool(POOL_PREFILL) if h.worker_id not in exclude}
        candidates = [
            PrefillCandidate(
                h.worker_id, h.load.queued_prompt_tokens + h.inflight_tokens, h.prefixes.matched_tokens(prefix)
            )
            for h in pool.values()
        ]
        chosen = self.prefill_policy.pick(prompt_len, candidates)
        return pool.get(chosen) if chosen else None

    def pick_decode(self, pool_id: int, needed_tokens: int, exclude: set[str]) -> Optional[WorkerHandle]:
        pool = {h.worker_id: h for h in self.registry.pool(pool_id) if h.worker_id not in exclude}
        candidates = [
            DecodeCandidate(
                h.worker_id, h.inflight, h.inflight_blocks, h.info.num_blocks, h.info.max_num_seqs, h.info.block_size
            )
            for h in pool.values()
        ]
        chosen = self.decode_policy.pick(needed_tokens, candidates)
        return pool.get(chosen) if chosen else None

    def no_capacity_error(self, pool: int) -> ServiceError:
        """What a request that waited its admission deadline for `pool` fails with; the client is
        told when to come back (a replacement engine starts within seconds)."""
        name = POOL_NAMES[pool]
        retry = self.config.retry_after_s
        if not self.registry.pool(pool):
            return ServiceError(ErrorCode.UNAVAILABLE, f"no {name} worker is available", retry_after_s=retry)
        return ServiceError(
            ErrorCode.RESOURCE_EXHAUSTED, f"every {name} worker is at capacity; retry later", retry_after_s=retry
        )

    def suspect(self, worker: WorkerHandle) -> None:
        """A call to `worker` failed as if it were gone: check it now, not at the next poll, so a
        dead engine leaves routing at once (the controller replaces it)."""
        self.run_later(self.registry.probe(worker))

    # ---- state ---------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, str]:
        pools = self.config.pools or ((POOL_PREFILL, POOL_DECODE) if self.disaggregated() else (POOL_COLOCATED,))
        missing = [POOL_NAMES[p] for p in pools if not self.registry.pool(p)]
        notes = "".join(f"; {note}" for _, note in sorted(self.notes.items()))
        if missing:
            return False, f"waiting for a ready worker in pool(s): {', '.join(missing)}{notes}"
        return True, f"ok{notes}"


def _route(progress, assembler: SampleAssembler):
    """What `SampleFlow.deltas` and `generate` do to an ordinary mid-stream delta, as one call."""
    place, push = progress.place, assembler.push
    return lambda delta: push(place(delta))


def _done_in_background(task: asyncio.Task) -> None:
    """A background call's failure is logged, not left unretrieved (its worker may be gone)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("a background call failed: %r", task.exception())
