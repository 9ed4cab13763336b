"""RMSNorm, computed in fp32 and cast back exactly as HF does, so logits match HF bit for bit in fp32.

The optional residual argument fuses the decoder's "add the residual, then normalise" into one
call: the sum is the new residual stream. The add runs in the activation dtype, as HF's does.
On CUDA the fused Triton kernel (`deepinfer_kernels.ops.rms_norm`) runs instead, with the same roundings.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import ops
from deepinfer_kernels.registry import use_triton


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., H]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual)."""
        if use_triton(x):
            return ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        summed = residual + x
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
