"""The vision transformers LLaVA-style models use as towers: CLIP and SigLIP, one implementation.

    pixels [N, 3, S, S] -> patch embedding -> (+ CLS token, CLIP) + position embedding
                        -> (pre-LayerNorm, CLIP) -> pre-norm encoder layers

`forward` returns the hidden states after the encoder layers a caller names (HF's
`hidden_states[i]`: 0 is the embedding output, i the output of layer i), running only as many
layers as the deepest one needs. The final `post_layernorm` and SigLIP's pooling head serve
CLIP/SigLIP's own image embedding, not LLaVA's features, so they are not built.
Parameter names are HF's (`embeddings.patch_embedding`, `encoder.layers.<i>.self_attn.q_proj`, ...).

The patch "conv" (kernel = stride = patch size) runs as one matmul over the flattened patches:
the same sums as HF's Conv2d, but through cuBLAS, whose fp32 matmuls are full fp32 under torch's
defaults, where cuDNN's fp32 convolutions default to TF32 (`torch.backends.cudnn.allow_tf32`:
inputs rounded to 10 mantissa bits). An fp32 engine thus stays on fp32 numerics on CUDA too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# vision model_type -> defaults HF's config classes fill for keys a checkpoint leaves out
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
        image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    ),
    "siglip_vision_model": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
        image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
    ),
}  # fmt: skip

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}") from None


@dataclass(frozen=True)
class ViTArgs:
    model_type: str  # "clip_vision_model" or "siglip_vision_model"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, vision_config: dict[str, Any]) -> ViTArgs:
        model_type = vision_config.get("model_type", "clip_vision_model")
        if model_type not in VISION_DEFAULTS:
            raise ValueError(
                f"unsupported vision tower model_type {model_type!r}; supported: {', '.join(VISION_DEFAULTS)}"
            )
        cfg = {**VISION_DEFAULTS[model_type], **vision_config}
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_channels=cfg["num_channels"],
            image_size=cfg["image_size"],
            patch_size=cfg["patch_size"],
            hidden_act=cfg["hidden_act"],
            layer_norm_eps=cfg["layer_norm_eps"],
        )

    @property
    def has_cls_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionEmbeddings(nn.Module):
    def __init__(self, args: ViTArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        d = args.hidden_size
        if args.has_cls_token:
            self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.patch_embedding = nn.Conv2d(
            args.num_channels, d, args.patch_size, stride=args.patch_size, bias=not args.has_cls_token, dtype=dtype
        )
        self.position_embedding = nn.Embedding(args.num_patches + int(args.has_cls_token), d, dtype=dtype)

    def _patch_embed(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, D]
        """HF's patch Conv2d (stride = kernel = p; pixels past the last whole patch unused) as a matmul."""
        n, c, p = pixels.shape[0], self.args.num_channels, self.args.patch_size
        g = self.args.image_size // p
        patches = pixels[:, :, : g * p, : g * p].reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        weight = self.patch_embedding.weight  # [D, C, p, p]
        return F.linear(
            patches.reshape(n, g * g, c * p * p), weight.reshape(weight.shape[0], -1), self.patch_embedding.bias
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P(+1), D]
        size = self.args.image_size
        if tuple(pixel_values.shape[1:]) != (self.args.num_channels, size, size):
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; the vision tower takes "
                f"[N, {self.args.num_channels}, {size}, {size}]"
            )
        x = self._patch_embed(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, P, D]
        if self.args.has_cls_token:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)  # [N, P+1, D]
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, args: ViTArgs, dtype: torch.dtype):
        super().__init__()
        d = args.hidden_size
        self.num_heads, self.head_dim = args.num_heads, d // args.num_heads
        self.q_proj = nn.Linear(d, d, dtype=dtype)
        self.k_proj = nn.Linear(d, d, dtype=dtype)
        self.v_proj = nn.Linear(d, d, dtype=dtype)
        self.out_proj = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P, D]
        N, P, D = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, nh, P, hd]
            return t.view(N, P, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        o = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.head_dim))  # [N, nh, P, hd]
        return self.out_proj(o.transpose(1, 2).reshape(N, P, D))


class VisionMLP(nn.Module):
    def __init__(self, args: ViTArgs, dtype: torch.dtype):
        super().__init__()
        self.act = activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, args: ViTArgs, dtype: torch.dtype):
        super().__init__()
        self.self_attn = VisionAttention(args, dtype)
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.mlp = VisionMLP(args, dtype)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, args: ViTArgs, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(args, dtype) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """A CLIP / SigLIP vision tower holding the first `num_layers` encoder layers."""

    def __init__(self, args: ViTArgs, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.embeddings = VisionEmbeddings(args, dtype)
        if args.has_cls_token:
            self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)  # HF's spelling
        self.encoder = VisionEncoder(args, num_layers, dtype)

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> list[torch.Tensor]:
        """pixel_values [N, C, S, S] -> the hidden states [N, P(+1), D] after each of `feature_layers`
        (indices into HF's hidden_states tuple, 0..num_layers)."""
        x = self.embeddings(pixel_values)
        if self.args.has_cls_token:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[: max(feature_layers)]:
            states.append(layer(states[-1]))
        return [states[i] for i in feature_layers]
