"""Image embeddings by content hash, least recently used first out, within a byte limit: a
repeated image is encoded once while it stays cached (a vision encoder's cache)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: int) -> Optional[torch.Tensor]:
        embeds = self._entries.get(content_hash)
        if embeds is not None:
            self._entries.move_to_end(content_hash)
        return embeds

    def put(self, content_hash: int, embeds: torch.Tensor) -> None:
        """Keep `embeds` (not copied: the caller gives it up); evicts the oldest to make room. An
        entry larger than the whole cache is not kept."""
        size = embeds.numel() * embeds.element_size()
        if size > self.capacity_bytes or content_hash in self._entries:
            return
        while self.bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[content_hash] = embeds
        self.bytes += size
