"""The attention layer models call: writes new K/V into the paged cache, then attends.

Models stay pure: they pass `AttentionMetadata` through `forward`; no module globals.
The kernel backend is chosen here: the torch references on CPU, the Triton kernels of
`deepinfer_kernels.ops` on CUDA (`deepinfer_kernels.registry` decides; `DEEPINFER_KERNEL_BACKEND=torch` forces
the references). Both Triton paths are free of host syncs, so decode can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_kernels import ops
from deepinfer_kernels.paged_attention import (
    paged_attention_ref,
    paged_decode_attention_static,
    reshape_and_cache,
    reshape_and_cache_static,
)
from deepinfer_kernels.registry import use_triton


@dataclass
class AttentionMetadata:
    """Attention inputs of one step over a flat batch of T new tokens from B sequences."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding, not written)
    block_tables: torch.Tensor  # [B, max_blocks] int32: KV block ids per sequence, 0-padded
    query_start_loc: torch.Tensor  # [B+1] int32: new tokens of seq b are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length including this step's new tokens
    query_lens_cpu: list[int]  # host copy of per-sequence new-token counts
    seq_lens_cpu: list[int]  # host copy of seq_lens
    is_decode_only: bool  # every sequence feeds exactly one token
    static_shapes: bool = False  # decode with fixed (B, W) shapes and no host sync (CUDA graphs)
    kv_written: list | None = None
    """When a list: each decoder layer appends, once its KV is in the cache, an event that
    completes then (a CUDA event; None on CPU, where the forward is synchronous) — a prefill
    engine sends a layer's KV as soon as it is written."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        if use_triton(q):
            return self._forward_triton(q, k, v, kv_cache, meta)
        if meta.static_shapes:
            reshape_and_cache_static(k, v, kv_cache, meta.slot_mapping)
            return paged_decode_attention_static(q, kv_cache, meta.block_tables, meta.seq_lens, self.scale)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        return paged_attention_ref(q, kv_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, self.scale)

    def _forward_triton(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)  # skips slot -1 on the device
        if meta.static_shapes or meta.is_decode_only:
            return ops.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, self.scale)
        max_query_len = max(meta.query_lens_cpu)
        return ops.paged_prefill_attention(
            q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max_query_len, self.scale
        )

    def kv_cache_block_shape(self, block_size: int) -> tuple[int, ...]:
        """Shape of one block of this layer's cache."""
        return (2, block_size, self.num_kv_heads, self.head_dim)
