"""The router's knobs."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.prefill_policy import DEFAULT_BUCKETS


@dataclass(frozen=True)
class RouterConfig:
    request_timeout_s: float = 600.0
    """End-to-end deadline of a request (a client may ask for less)."""
    admission_timeout_s: float = 60.0
    """How long a request may wait for a worker with room before RESOURCE_EXHAUSTED."""
    reserve_timeout_s: float = 10.0
    """Deadline of one CE Reserve call."""
    prefill_timeout_s: float = 120.0
    """Deadline of one PE Prefill call (queueing + prefill + KV transfer)."""
    lease_s: float = 130.0
    """CE reservation lease: longer than a prefill may take, so a slow PE does not lose it."""
    max_prefill_attempts: int = 3
    """Prefills tried (on different PEs) before a request fails; only before any token was sent."""
    max_n: int = 16
    """Largest `n` a request may ask for."""
    poll_interval_s: float = 0.5
    """How often the router polls each worker's Stats (health and load)."""
    prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    pools: tuple[int, ...] = ()
    """Pools that must each have a ready worker before the router is ready (empty: any path)."""
