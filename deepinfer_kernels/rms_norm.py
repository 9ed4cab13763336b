"""RMSNorm with an optional fused residual add: the pure-torch reference.

Numerics follow HF: normalise in fp32, cast back to the activation dtype, then multiply by
the weight (so the product's dtype is the promotion of the two). The residual add runs in
the activation dtype. The Triton kernel reproduces these roundings exactly.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`: (norm(x + residual) * weight, x + residual)."""
    if residual is not None:
        x = residual + x
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)
