"""`PendingWrite`: what a PE tracks of one request's KV writes to its CE until the hand-off."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.sequence import Sequence
from deepinfer_core.transfer.messages import KVTarget
from deepinfer_core.transfer.nixl_agent import Transfer


@dataclass
class PendingWrite:
    """One request's writes to its CE: chunk writes first (streamed), the hand-off's last."""

    seq: Sequence
    target: KVTarget
    transfers: list[Transfer] = field(default_factory=list)
    """Posted and not yet known to be done."""
    sent_blocks: int = 0
    """Blocks of the block table posted so far (a prefix)."""
    num_bytes: int = 0
    first_post: float = 0.0
    last_post: float = 0.0
    error: Optional[str] = None
    seconds: float = 0.0
    exposed_seconds: float = 0.0
    last_hidden: Optional[torch.Tensor] = None
    """[H]: the prompt's last hidden state, for a CE that drafts (models with an MTP layer)."""
