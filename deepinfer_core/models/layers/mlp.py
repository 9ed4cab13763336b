"""The SwiGLU feed-forward block of Llama-style decoders: down(silu(gate(x)) * up(x)).

Gate and up stay separate parameters named as in HF checkpoints; packing them into one GEMM is
a weight transform applied from outside the model, not a model concern.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        hidden_act: str = "silu",
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"SwiGLU MLP needs hidden_act='silu', got {hidden_act!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [T, I]
        return self.down_proj(h)
