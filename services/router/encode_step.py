"""The E of E -> P -> D: a sample's images to a vision encoder, leases on their embeddings back.

The encoder is the one with the fewest images queued (its last report plus what this router
has sent it since). An encoder that is full (RESOURCE_EXHAUSTED) or gone is left for another,
or waited for until the admission deadline; then the client hears RESOURCE_EXHAUSTED (429). An
image the encoder cannot decode is the client's fault (INVALID_ARGUMENT) and ends the request.
Leases a prefill engine did not read (its prefill failed, the request was aborted) are released
at once rather than left to expire.
"""

from __future__ import annotations

import time
from typing import Optional

from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_ENCODER
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

    async def encode(self, sub_id: str) -> list[EmbeddingHandle]:
        """Leases on the flow's images, in order."""
        flow, refused = self.flow, set()
        give_up = min(flow.deadline, time.monotonic() + self.router.config.admission_timeout_s)
        while True:
            ve = await flow._wait_for(POOL_ENCODER, lambda ex: pick_encoder(self.router.registry, ex), refused)
            flow._hold(ve, len(flow.images), "encoder")
            try:
                timeout = min(self.router.config.pd.prefill_timeout_s, flow.remaining())
                handles = await ve.client.encode(sub_id, flow.images, timeout)
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
            return handles

    def release(self, handles: list[EmbeddingHandle]) -> None:
        """Free leases no prefill engine will read (idempotent at the encoder)."""
        ve = next((h for h in self.router.registry.pool(POOL_ENCODER, False) if h is self._encoder), None)
        if ve is not None and handles:
            self.router.run_later(ve.client.release([h.lease_id for h in handles]))
