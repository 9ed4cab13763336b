"""The router's knobs."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.config import PDConfig
from services.common.limits import DEFAULT_MIGRATION_LIMIT, RequestLimits
from services.router.prefill_policy import DEFAULT_BUCKETS


@dataclass(frozen=True)
class RouterConfig:
    limits: RequestLimits = RequestLimits()
    """`max_n` and the end-to-end deadline (the gateway's too)."""
    pd: PDConfig = PDConfig()
    """The hand-off's clocks, the engines' own: the CE lease asked for on Reserve and renewed while the
    prefill runs (`renewed_lease_s`), and the deadline of one PE Prefill call (queueing + prefill + KV transfer)."""
    admission_timeout_s: float = 60.0
    """How long a request may wait for a worker with room before RESOURCE_EXHAUSTED."""
    retry_after_s: float = 2.0
    """What a request refused for want of a worker tells the client to wait (HTTP `Retry-After`)."""
    reserve_timeout_s: float = 10.0
    """Deadline of one CE Reserve call."""
    max_prefill_attempts: int = 3
    """Prefills tried (on different PEs) before a request fails; only before any token was sent."""
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    """Times one sample may move to another prefill/decode pair after its decode engine died or its
    stream broke mid-request (0: such a stream ends with an error)."""
    failed_pool_grace_s: float = 5.0
    """A retried prefill whose every ready PE already failed it waits this long for one of them to
    leave (dead) or a new one to join before the request fails."""
    writer_death_wait_s: float = 30.0
    """How long the release of a reservation fenced against an unreachable PE waits for that PE to be
    declared dead (then the blocks are freed at once; else they wait out the lease and its grace)."""
    poll_interval_s: float = 0.5
    """How often the router polls each worker's Stats (health and load)."""
    prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    pools: tuple[int, ...] = ()
    """Pools that must each have a ready worker before the router is ready (empty: any path)."""
