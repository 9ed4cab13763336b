"""KV-cache maintenance: the block copy of forked sequences, pure-torch reference.

`reshape_and_cache` (writing a step's new K/V into their slots) has its reference in
`paged_attention.py`.
"""

from __future__ import annotations

import torch


def copy_blocks_ref(
    kv_buffer: torch.Tensor,  # [num_layers, num_blocks, *block_shape]
    src: torch.Tensor,  # [P] int: source block ids
    dst: torch.Tensor,  # [P] int: destination block ids (distinct, disjoint from src)
) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer."""
    kv_buffer[:, dst.long()] = kv_buffer[:, src.long()]
