"""A vision encoder worker's settings (plain values: the head builds them without torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderConfig:
    max_batch_images: int = 16
    """Images in one forward of the tower, from any number of requests."""
    max_wait_s: float = 0.005
    """How long a batch that is not full waits for more images after its first."""
    max_queue_images: int = 256
    """Images waiting for a batch; more are refused (429) rather than queued without bound."""
    pool_bytes: int = 64 * 1024 * 1024
    """The NIXL-registered embedding pool: parked images beyond it are refused (429)."""
    lease_s: float = 30.0
    """A parked image not read (nor released) in this long is freed."""
    cache_bytes: int = 64 * 1024 * 1024
    """The encoder cache (by content hash); 0 turns it off."""
