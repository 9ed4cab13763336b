"""The pre-norm decoder layer every family here shares: attention and feed-forward, each behind an
RMSNorm, with the residual add fused into the following norm.

Families differ only in the two sublayers they pass in (GQA or MLA attention; a dense SwiGLU MLP
or a mixture of experts), which keep HF's names `self_attn` and `mlp`.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.layers.norm import RMSNorm


def _queue_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.self_attn = self_attn  # (x [T, H], rope, kv_cache, meta) -> [T, H]
        self.mlp = mlp  # [T, H] -> [T, H]
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]: the previous layer's output
        residual: torch.Tensor | None,  # [T, H]: the residual stream before that output
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        if meta.kv_written is not None:  # this layer's KV is in the cache once the queue gets here
            meta.kv_written.append(_queue_event(x.device))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
