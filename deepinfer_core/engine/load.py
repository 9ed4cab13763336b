"""`EngineLoad`: what a host reads off an engine to route, scale and report on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineLoad:
    """A snapshot taken on the engine's thread (`LLMEngine.load()`); plain values, safe to share."""

    queued_prompt_tokens: int = 0
    """Prompt tokens waiting to be computed."""
    running_requests: int = 0
    """Sequences decoding, or handed off and about to (a CE's `prompted`)."""
    waiting_requests: int = 0
    total_kv_tokens: int = 0
    """Tokens the running, prompted and reserved sequences hold in the KV cache."""
    kv_usage: float = 0.0
    free_blocks: int = 0
    num_blocks: int = 0
    requests: int = 0
    """Requests the engine still holds in any form (scheduled, reserved, or in a hand-off)."""
    reservations: int = 0
    """CE: KV reservations waiting for their hand-off."""
    prefix_queries: int = 0
    prefix_hits: int = 0
    kv_transfer_bytes: int = 0
    """PE: bytes its KV writes have sent."""
    handoffs: int = 0
    """CE: hand-offs received."""
