"""The per-request limits that the gateway and the router both enforce: one definition of each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16
    """Largest `n` (samples per prompt) a request may ask for."""
    request_timeout_s: float = 600.0
    """End-to-end deadline of a request (a client may ask for less)."""


DEFAULT_MIGRATION_LIMIT = 3
"""Times one sample may move to a healthy prefill/decode pair after its decode engine died or its
stream broke mid-request (`--migration-limit`; the router's `RouterConfig.migration_limit`)."""
