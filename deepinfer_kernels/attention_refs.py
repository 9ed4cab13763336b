"""Device-tensor signatures of the paged attention references (the Triton kernels' twins).

The engine's CPU path calls `paged_attention.py` with host lists; the kernels take the
device tensors of `AttentionMetadata` instead, so their references take the same.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.paged_attention import paged_attention_ref, paged_decode_attention_static


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32: context incl. the new tokens
    max_query_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its cached prefix and themselves."""
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    return paged_attention_ref(query, kv_cache, block_tables, query_lens, seq_lens.tolist(), scale)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """One new token per sequence attending to its whole context (fixed shapes, no host sync)."""
    return paged_decode_attention_static(query, kv_cache, block_tables, seq_lens, scale)
