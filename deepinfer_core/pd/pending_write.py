"""`PendingWrite`: what a PE tracks of one request's KV writes to its CE until the hand-off."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.errors import TransferError
from deepinfer_core.sequence import Sequence
from deepinfer_core.transfer.messages import KVTarget
from deepinfer_core.transfer.nixl_agent import NixlKVAgent, Transfer


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

    def expired(self) -> bool:
        """Whether the CE's reservation has run out (recorded as the error): nothing more is posted."""
        if self.target.expires_at and time.time() > self.target.expires_at:
            self.error = self.error or "the KV reservation expired before the prefill finished"
            return True
        return False

    def wait_all(self, agent: NixlKVAgent, timeout_s: float) -> None:
        """Wait for every posted write of the request; the first failure is its error."""
        for transfer in self.transfers:
            try:
                agent.wait(transfer, timeout_s)
                self.num_bytes += transfer.num_bytes
            except TransferError as e:
                self.error = self.error or str(e)
        self.transfers = []
