"""What a prefill engine answers once a request's hand-off is done (the reply of `Prefill`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.deltas import SampleDelta


@dataclass
class PrefillResult:
    first: SampleDelta
    """The first token, its text and logprobs (never finished: the CE decides that)."""
    kv_bytes: int = 0
    """Bytes written into the CE's blocks."""
    kv_seconds: float = 0.0
    """First post (an early chunk's, when streamed) to completion of the last KV write."""
    queue_seconds: float = 0.0
    """Admission to the first prefill step."""
    kv_exposed_seconds: float = 0.0
    """End of the prefill forward to completion of every write: what the hand-off adds to TTFT."""
    embeds_seconds: float = 0.0
    """Reading the images' embeddings from vision encoders (0 without)."""
