"""The E of E -> P -> D: a sample's images to a vision encoder, leases on their embeddings back.

The encoder is the one with the fewest images queued (its last report plus what this router
has sent it since). An encoder that is full (RESOURCE_EXHAUSTED) or gone is left for another,
or waited for until the admission deadline; then the client hears RESOURCE_EXHAUSTED (429). An
image the encoder cannot decode is the client's fault (INVALID_ARGUMENT) and ends the request.
The leases are short (`PDConfig.renewed_lease_s`) and renewed (`LeaseKeeper`) from the encode
until the PE's prefill call ends, however long the request waits for a CE and a PE meanwhile;
leases a prefill engine did not read (its prefill failed, it died, the request was aborted or
cancelled) are released at once rather than left to expire, and a router that dies stops
renewing them: the encoder frees them one short lease later.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Optional

from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_ENCODER
from services.router.lease_keeper import LeaseKeeper
from services.router.registry import WorkerHandle

_REFUSED = (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED)


def pick_encoder(registry, exclude: set[str]) -> Optional[WorkerHandle]:
    """Fewest queued images first (ties: fewest requests in flight)."""
    pool = [h for h in registry.pool(POOL_ENCODER) if h.worker_id not in exclude]
    if not pool:
        return None
    return min(pool, key=lambda h: (h.load.encoder_queue_images + h.inflight_tokens, h.inflight, h.worker_id))


class EncodeStep:
    def __init__(self, flow):
        self.flow = flow
        self.router = flow.router
        self._encoder: Optional[WorkerHandle] = None
        """The encoder that holds the leases of the last `encode`."""
        self._keeper: Optional[LeaseKeeper] = None

    async def encode(self, sub_id: str) -> list[EmbeddingHandle]:
        """Leases on the flow's images, in order, renewed until `settled` or `release`: the list
        returned is kept up to date (each handle carries the lease's end now)."""
        flow, refused = self.flow, set()
        give_up = min(flow.deadline, time.monotonic() + self.router.config.admission_timeout_s)
        while True:
            ve = await flow._wait_for(POOL_ENCODER, lambda ex: pick_encoder(self.router.registry, ex), refused)
            flow._hold(ve, len(flow.images), "encoder")
            lease_s = self.router.config.pd.renewed_lease_s
            try:
                timeout = min(self.router.config.pd.prefill_timeout_s, flow.remaining())
                handles = await ve.client.encode(sub_id, flow.images, timeout, lease_s)
            except ServiceError as e:
                if e.code not in _REFUSED:
                    raise
                if time.monotonic() >= give_up:  # every encoder stayed full: the client retries later
                    raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"no encoder had room: {e.message}") from None
                refused.add(ve.worker_id)
                continue
            finally:
                flow._release(ve, len(flow.images))
            self._encoder = ve
            self._keeper = LeaseKeeper(ve, sub_id, lease_s, _renewer(handles))
            return handles

    def settled(self) -> None:
        """The PE's prefill call ended (it read the leases, or `release` follows): no more beats."""
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None

    def release(self, handles: list[EmbeddingHandle]) -> None:
        """Free leases no prefill engine will read (idempotent at the encoder)."""
        self.settled()
        ve = next((h for h in self.router.registry.pool(POOL_ENCODER, False) if h is self._encoder), None)
        if ve is not None and handles:
            self.router.run_later(ve.client.release([h.lease_id for h in handles]))


def _renewer(handles: list[EmbeddingHandle]) -> Callable[[float], None]:
    """The handles a PE has not been sent yet carry the leases' new end (a reader refuses a handle
    near its end: one that waited past the first end would be refused although still held)."""

    def renewed(expires_at: float) -> None:
        handles[:] = [dataclasses.replace(h, expires_at=expires_at) for h in handles]

    return renewed
