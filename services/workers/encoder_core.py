"""The vision encoder worker (VE): images of many requests, batched, into leased embeddings.

    Encode(images) -> decode + preprocess on a thread pool -> queue (bounded: 429 beyond it)
      -> the encoder thread takes up to `max_batch_images` (waiting `max_wait_s` for more after
         the first), one forward (cache hits skip it) -> each request's images parked -> leases

A request whose caller went away (client disconnect, router abort) while it was queued or
encoding parks nothing; one that went away just after parking has its leases released. Every
other lease ends with the reader's notice, `Release`, or its expiry: the pool empties itself.
The router asks for a short lease and renews it by the request's id while the request waits
for a prefill engine to read it (`renew_lease`, the router's `LeaseKeeper`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from deepinfer_core.errors import InvalidRequestError
from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from deepinfer_core.multimodal.embedding_pool import PoolFull
from deepinfer_core.multimodal.encoder_runner import VisionEncoderRunner
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import WorkerLoad

_REAP_EVERY_S = 0.05
"""How often an idle encoder thread frees read and expired leases."""


@dataclass
class _Job:
    request_id: str
    items: list  # (pixels, content hash) per image
    lease_s: float = 0.0  # 0: the pool's own
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EncoderCore:
    def __init__(self, runner: VisionEncoderRunner, worker_id: str = "", loop=None):
        self.runner = runner
        self.config = runner.config
        self.worker_id = worker_id or "encoder"
        self.loop = loop or asyncio.get_running_loop()
        self.draining = False
        self.error: Optional[str] = None
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued_images = 0
        self._cv = threading.Condition()
        self._pool_lock = threading.Lock()  # the pool is touched by the encoder thread and Release
        self._stop = threading.Event()
        self._decoders = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ve-decode")
        self._thread = threading.Thread(target=self._run, name=f"encoder-{self.worker_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._thread.join(10)
        self._decoders.shutdown(wait=False)

    def end_subscriptions(self) -> None:
        """A VE has no subscriptions."""

    # ---- requests --------------------------------------------------------------------------
    async def encode(self, request_id: str, images: list[bytes], lease_s: float = 0.0) -> list[EmbeddingHandle]:
        """A lease per image, in order, for `lease_s` (0: `EncoderConfig.lease_s`), renewable under
        `request_id`. INVALID_ARGUMENT for an image that does not decode, RESOURCE_EXHAUSTED when
        the queue or the pool is full."""
        self._check_accepting(len(images))
        jobs = [self.loop.run_in_executor(self._decoders, self.runner.preprocess, image) for image in images]
        try:
            items = await asyncio.gather(*jobs)
        except InvalidRequestError as e:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        job = _Job(request_id, list(items), lease_s)
        with self._cv:
            self._check_accepting(len(images))
            self._jobs.append(job)
            self._queued_images += len(images)
            self._cv.notify()
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def _check_accepting(self, num_images: int) -> None:
        if self.draining or self.error is not None:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"encoder {self.worker_id} is {self.error or 'draining'}")
        if self._queued_images + num_images > self.config.max_queue_images:
            raise ServiceError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"encoder {self.worker_id} has {self._queued_images} images queued "
                f"(limit {self.config.max_queue_images}); retry later",
            )

    def _cancel(self, job: _Job) -> None:
        """The caller went away: park nothing for it, or free what was parked."""
        with job.lock:
            job.cancelled = True
            parked = job.future.done() and not job.future.cancelled() and job.future.exception() is None
        if parked:
            self.release([h.lease_id for h in job.future.result()])

    def release(self, lease_ids: list[int]) -> int:
        """Free leases early; how many were still held."""
        with self._pool_lock:
            return sum(self.runner.pool.release(i) for i in lease_ids)

    async def renew_lease(self, request_id: str, lease_s: float) -> float:
        """A heartbeat: the request's unread leases last `lease_s` from now. Their end (wall
        clock), 0.0 when none is left (read, released or expired: nothing to keep)."""
        with self._pool_lock:
            return self.runner.pool.renew(request_id, lease_s)

    # ---- the encoder thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._next_batch()
            with self._pool_lock:
                self.runner.pool.reap()
            if not batch:
                continue
            try:
                self._encode(batch)
            except Exception as e:  # a broken encoder: every caller hears it, the worker reports unhealthy
                self.error = f"down: {type(e).__name__}: {e}"
                for job in batch:
                    job.future.set_exception(ServiceError(ErrorCode.INTERNAL, f"encoder {self.error}"))
                return

    def _next_batch(self) -> list[_Job]:
        """Jobs of up to `max_batch_images` images: the first waits for work, the rest at most
        `max_wait_s` after it."""
        with self._cv:
            if not self._jobs:
                self._cv.wait(_REAP_EVERY_S)
            if not self._jobs:
                return []
            deadline = time.monotonic() + self.config.max_wait_s
            while self._queued_images < self.config.max_batch_images and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            batch, count = [], 0
            while self._jobs and (not batch or count + len(self._jobs[0].items) <= self.config.max_batch_images):
                job = self._jobs.popleft()
                self._queued_images -= len(job.items)
                if job.future.set_running_or_notify_cancel():  # from now on the caller cannot cancel it
                    batch.append(job)
                    count += len(job.items)
            return batch

    def _encode(self, batch: list[_Job]) -> None:
        live = [job for job in batch if not job.cancelled]
        items = [item for job in live for item in job.items]
        embeds = self.runner.embed(items) if items else []
        start = 0
        for job in live:
            mine = embeds[start : start + len(job.items)]
            start += len(job.items)
            with job.lock, self._pool_lock:
                if job.cancelled:
                    continue
                try:
                    hashes = [h for _, h in job.items]
                    job.future.set_result(self.runner.park(mine, hashes, job.request_id, job.lease_s))
                except PoolFull as e:
                    job.future.set_exception(ServiceError(ErrorCode.RESOURCE_EXHAUSTED, str(e)))
        for job in batch:
            if not job.future.done():
                job.future.set_exception(ServiceError(ErrorCode.CANCELLED, f"request {job.request_id} was aborted"))

    # ---- state ----------------------------------------------------------------------------------
    def stats(self) -> WorkerLoad:
        leases = self.runner.pool.leased
        return WorkerLoad(
            worker_id=self.worker_id,
            draining=self.draining,
            requests=len(self._jobs) + leases,
            waiting_requests=len(self._jobs),
            encoder_images=self.runner.images_encoded,
            encoder_cache_hits=self.runner.cache_hits,
            encoder_queue_images=self._queued_images,
            embedding_leases=leases,
            embedding_lease_renewals=self.runner.pool.renewals,
        )

    def health(self) -> tuple[bool, str]:
        if self.error is not None or not self._thread.is_alive():
            return False, f"encoder {self.error or 'stopped'}"
        return True, "draining" if self.draining else "ok"

    def drain(self) -> int:
        self.draining = True
        return self.stats().requests
