"""Llama-family dense decoders: Llama, Mistral, Qwen2 and Qwen3 in one implementation.

The four differ only in switches a config settles (`LlamaArgs.from_hf`): Qwen2 has q/k/v
biases and an unbiased o_proj; Qwen3 RMS-normalises each query and key head before RoPE; Llama
and Mistral take `attention_bias` / `mlp_bias` from the config. All use GQA, SwiGLU, RMSNorm
and neox RoPE, with tied or untied embeddings.

The model is pure: it reads the step's layout from `AttentionMetadata` and writes K/V into the
per-layer paged caches it is handed; parameter names equal HF checkpoint names, so loading is a
name lookup and weight packing (if any) is applied from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.attention import Attention, AttentionMetadata
from deepinfer_core.models.layers.decoder import DecoderLayer
from deepinfer_core.models.layers.mlp import SwiGLUMLP
from deepinfer_core.models.layers.norm import RMSNorm
from deepinfer_core.models.layers.rotary import apply_rotary, get_rope


def active_sliding_window(hf_config: dict[str, Any]) -> int | None:
    """The attention window the config turns on, or None when every layer attends fully."""
    window = hf_config.get("sliding_window")
    if window is None:
        return None
    if "sliding_attention" in (hf_config.get("layer_types") or []):
        return window
    if hf_config.get("model_type") in ("mistral", "mixtral"):
        return window
    return window if hf_config.get("use_sliding_window") else None


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture switches of one Llama-family checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    tie_word_embeddings: bool
    sliding_window: int | None  # active window, None for full attention

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaArgs:
        model_type = cfg.get("model_type", "llama")
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            hidden_act=cfg.get("hidden_act", "silu"),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=active_sliding_window(cfg),
        )


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        if args.num_heads % args.num_kv_heads:
            raise ValueError(f"num_attention_heads={args.num_heads} is not a multiple of {args.num_kv_heads=}")
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=args.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype) if args.qk_norm else None
        self.attn = Attention(args.num_heads, d, args.num_kv_heads, scale=d**-0.5)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, D/2] each
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # q: [T, Hq, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # k: [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # v: [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attn(q, k, v, kv_cache, meta)  # o: [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


# layer index -> that layer's feed-forward block, or None for the dense SwiGLU MLP
MakeMLP = Callable[[int], "nn.Module | None"]


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype, mlp: nn.Module | None = None):
        if mlp is None:
            mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, dtype)
        super().__init__(LlamaAttention(args, dtype), mlp, args.hidden_size, args.rms_norm_eps, dtype)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, hf_config: dict[str, Any], dtype: torch.dtype, make_mlp: MakeMLP | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        make_mlp = make_mlp or (lambda i: None)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype, make_mlp(i)) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)
        self.rotary_emb = get_rope(hf_config, args.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one [num_blocks, 2, block_size, Hkv, D] per layer
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]: replaces the token embeddings (images)
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # x: [T, H]
        rope = self.rotary_emb(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, make_mlp: MakeMLP | None = None):
        super().__init__()
        hf_config = normalize_hf_config(hf_config)
        self.args = LlamaArgs.from_hf(hf_config)
        self.model = LlamaModel(self.args, hf_config, dtype, make_mlp)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False, dtype=dtype)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_kv_cache_layers = self.args.num_layers
        self.sliding_window = self.args.sliding_window
        self.max_positions = self.model.rotary_emb.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]
    ) -> torch.Tensor:  # [T, H]
        return self.model(input_ids, positions, kv_caches, attn_meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head(hidden).float()

    def kv_cache_block_shape(self, block_size: int) -> tuple[int, ...]:
        return self.model.layers[0].self_attn.attn.kv_cache_block_shape(block_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters of the same name; returns the names used.

        Names the model has no parameter for are left unconsumed (the loader reports them).
        A tied checkpoint's `lm_head.weight` is consumed without copying: it is the embedding.
        """
        params = dict(self.named_parameters())
        consumed: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                consumed.add(name)
                continue
            param = params.get(name)
            if param is None:
                continue
            if param.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            consumed.add(name)
        return consumed
