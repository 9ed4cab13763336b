"""Where one image's embeddings wait in a vision encoder's transfer pool: what a prefill engine
needs to READ them over NIXL. Plain values (no torch): the router passes handles on unread."""

from __future__ import annotations

from dataclasses import dataclass

EMBEDDINGS_UNAVAILABLE = "image embeddings unavailable"
"""How a prefill engine's error reads when it could not read a request's embeddings (the lease
expired, the encoder is gone, the READ failed): the router encodes again and retries once."""


@dataclass(frozen=True)
class EmbeddingHandle:
    """A lease on one image's embeddings [tokens_per_image, hidden] in an encoder's pool. The
    encoder frees it when the reader's notice (after its READ) arrives, when the router
    releases it, or at `expires_at`, whichever comes first."""

    agent_name: str  # the encoder's NIXL agent
    agent_metadata: bytes  # lets a reader connect on first sight
    addr: int  # address of the embeddings in the encoder's registered pool
    num_bytes: int
    shape: tuple[int, ...]  # [tokens_per_image, hidden]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    content_hash: int  # signed 64-bit identity of the image (encoder cache, prefix-cache keys)
    lease_id: int
    expires_at: float  # wall-clock time (the encoder's) after which the bytes may be reused
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    device_id: int = 0

    def done_notice(self) -> bytes:
        """The NIXL notice a reader sends the encoder once its READ completed: frees the lease."""
        return f"embeds-read:{self.lease_id}".encode()


def lease_of_notice(message: bytes) -> int | None:
    """The lease a reader's notice frees; None for any other notice."""
    text = message.decode(errors="replace")
    return int(text.split(":", 1)[1]) if text.startswith("embeds-read:") else None
