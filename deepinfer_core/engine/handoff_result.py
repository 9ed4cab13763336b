"""`HandoffResult`: how one request's hand-off from a prefill engine ended, for its host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class HandoffResult:
    """How one request's hand-off ended, for the caller of the PE (router, harness)."""

    request_id: str
    ok: bool
    first_token: int = -1
    num_computed_tokens: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    """First post (an early chunk's, when streamed) to completion of the last KV write."""
    exposed_seconds: float = 0.0
    """From the end of the last forward (its last layer group posted) to completion of every
    write: what the hand-off adds to TTFT."""
    error: Optional[str] = None
