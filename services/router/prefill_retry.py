"""Which prefill failures the router retries on another PE (or with a fresh CE reservation), and
the signal that carries one out of a sample's prefill attempt."""

from __future__ import annotations

from services.common.errors import ErrorCode, ServiceError

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
