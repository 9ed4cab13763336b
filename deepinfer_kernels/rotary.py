"""Neox-style rotary embedding by a looked-up cos/sin pair: the pure-torch reference.

The caller looks up each token's rows of a precomputed table (any scaling, YaRN included, is
only a different table), so the op itself is the rotation of the two halves of each head.
"""

from __future__ import annotations

import torch


def rotary_ref(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D/2] fp32
    sin: torch.Tensor,  # [T, D/2] fp32
) -> torch.Tensor:  # [T, H, D]
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with cos/sin cast to x's dtype first (as HF)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
