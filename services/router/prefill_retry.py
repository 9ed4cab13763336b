"""Which prefill failures the router retries on another PE (or with a fresh CE reservation), and
the signal that carries one out of a sample's prefill attempt."""

from __future__ import annotations

from deepinfer_core.multimodal.embedding_handle import EMBEDDINGS_UNAVAILABLE
from services.common.errors import ErrorCode, ServiceError
from services.metrics import definitions as m

RETRIED_PREFILL = frozenset(
    {
        ErrorCode.UNAVAILABLE,  # the PE is gone or draining
        ErrorCode.RESOURCE_EXHAUSTED,  # the PE has no room now
        ErrorCode.FAILED_PRECONDITION,  # the PE refused the CE's target: a fresh reservation may do
        ErrorCode.INTERNAL,  # the KV transfer failed
    }
)
"""Prefill failures that may succeed on another PE (or CE); any other code ends the request."""
BLAMES_THE_CE = (ErrorCode.INTERNAL, ErrorCode.FAILED_PRECONDITION)
"""The PE answered but the hand-off failed (transfer error, stale lease): the CE is suspect."""


class RetryPrefill(Exception):
    def __init__(self, error: ServiceError, worker_id: str, decode_side: str):
        super().__init__(error.message)
        self.error = error
        self.worker_id = worker_id
        """The PE that failed."""
        self.decode_side = decode_side
        """The CE to blame instead of the PE ("" = the PE's fault)."""


def excluded_after(retry: RetryPrefill, lost_before: int, tried_pe: set[str], suspect_ce: set[str]) -> int:
    """A failed attempt to retry: the side that failed is left out of the next one (`tried_pe`,
    `suspect_ce`). Returns 1 when it was the encoder's lease (not the PE) that failed; a second
    such failure ends the request: the read failed after a fresh encode too, so say so, never guess."""
    lost = EMBEDDINGS_UNAVAILABLE in retry.error.message
    if lost and lost_before:
        raise ServiceError(ErrorCode.UNAVAILABLE, retry.error.message) from None
    if not lost:
        (suspect_ce if retry.decode_side else tried_pe).add(retry.decode_side or retry.worker_id)
    m.ROUTER_RETRIES.labels(retry.error.code.name).inc()
    return int(lost)
