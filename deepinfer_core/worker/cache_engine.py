"""The paged KV cache tensors of one engine.

All layers live in ONE allocation `kv_buffer[num_layers, num_blocks, *block_shape]`, so
the transfer plane registers a single memory region, and one (layer, block) region is
contiguous: a request's KV moves as one descriptor per layer and block.
"""

from __future__ import annotations

import torch

from deepinfer_core.worker.events import to_device
from deepinfer_kernels import ops


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        block_shape: tuple[int, ...],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        state_shape: tuple[int, ...] | None = None,
        num_state_slots: int = 0,
        num_draft_layers: int = 0,
    ):
        self.num_layers = num_layers
        self.block_shape = block_shape
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        # One extra block past the pool: the write target of padded rows in captured decode graphs.
        self.scratch_block = num_blocks
        self.kv_buffer = torch.zeros((num_layers, num_blocks + 1, *block_shape), dtype=dtype, device=device)
        self.kv_caches: list[torch.Tensor] = list(self.kv_buffer.unbind(0))
        # A draft model's layers (MTP) index the same blocks but live apart: the transfer plane
        # registers `kv_buffer` alone, so a PE (which drafts nothing) and a CE share one layout.
        self.draft_kv_buffer = torch.zeros((num_draft_layers, num_blocks + 1, *block_shape), dtype=dtype, device=device)
        self.draft_kv_caches: list[torch.Tensor] = list(self.draft_kv_buffer.unbind(0))
        # Per-sequence state slots (sliding-window / recurrent state) and their copy area.
        self.states = self.copy_states = None
        if state_shape is not None and num_state_slots > 0:
            self.states = torch.zeros((num_state_slots, *state_shape), dtype=dtype, device=device)
            self.copy_states = torch.zeros_like(self.states)

    @staticmethod
    def bytes_per_block(num_layers: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        elems = 1
        for d in block_shape:
            elems *= d
        return num_layers * elems * torch.empty((), dtype=dtype).element_size()

    @property
    def block_bytes_per_layer(self) -> int:
        return self.kv_buffer[0, 0].numel() * self.kv_buffer.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (forked sequences' last blocks)."""
        if not pairs:
            return
        src = to_device([p[0] for p in pairs], torch.int64, self.device)  # no wait for the running step
        dst = to_device([p[1] for p in pairs], torch.int64, self.device)
        ops.copy_blocks(self.kv_buffer, src, dst)
        if self.draft_kv_caches:  # a fork's draft KV moves with its block
            ops.copy_blocks(self.draft_kv_buffer, src, dst)

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        if self.states is None or not pairs:
            return
        for src, dst in pairs:
            self.states[dst].copy_(self.states[src])
