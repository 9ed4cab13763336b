"""DeepSeek-V3 (and V2 / V2-Lite): multi-head latent attention plus DeepSeekMoE.

    layer i:  MLA attention  ->  dense SwiGLU MLP            (i < first_k_dense_replace)
                             ->  shared experts + routed experts (otherwise, every moe_layer_freq)

V3 routes with sigmoid scores, an `e_score_correction_bias` used only for choosing, group-limited
top-k (group score = sum of its two best experts) and renormalised weights times
`routed_scaling_factor`; V2 uses softmax scores, greedy or group-limited (group score = max)
top-k. Both read as `RoutingConfig`s. The paged cache holds one latent vector per token
(`kv_cache_block_shape` -> [block_size, kv_lora_rank + qk_rope_head_dim]).

A V3 checkpoint's multi-token-prediction layers (`model.layers.<num_hidden_layers + i>.*`) are
skipped on load. From the FP8 release (block-scaled e4m3) the routed experts, the bulk of the
weights, stay FP8; the loader dequantizes the other projections to the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.layers.decoder import DecoderLayer
from deepinfer_core.models.layers.mla import MLAArgs, MLAAttention
from deepinfer_core.models.layers.mlp import SwiGLUMLP
from deepinfer_core.models.layers.moe import RoutingConfig, SparseMoeBlock
from deepinfer_core.models.layers.norm import RMSNorm
from deepinfer_core.models.layers.rotary import get_rope, rope_parameters, yarn_mscale
from deepinfer_core.models.quantization import fp8_block_size
from deepinfer_core.models.weights import expected_weight_names, expert_filter, load_weights_by_name


def mla_softmax_scale(hf_config: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled RoPE (YaRN)."""
    scale = (hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def deepseek_routing(cfg: dict[str, Any]) -> RoutingConfig:
    v3 = cfg.get("model_type") == "deepseek_v3"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    grouped = method != "greedy"
    return RoutingConfig(
        num_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        topk_method=method,
        n_group=(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        router_fp32=True,
    )


@dataclass(frozen=True)
class DeepseekArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' MLP width
    moe_intermediate_size: int  # one routed expert's width
    num_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_shared_experts: int
    routing: RoutingConfig | None  # None: every layer dense
    mla: MLAArgs
    rms_norm_eps: float
    tie_word_embeddings: bool
    fp8_block: tuple[int, int] | None = None  # an FP8 checkpoint's routed experts stay FP8

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekArgs:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek models need hidden_act='silu', got {cfg['hidden_act']!r}")
        eps = cfg.get("rms_norm_eps", 1e-6)
        mla = MLAArgs(
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rms_norm_eps=eps,
            attention_bias=bool(cfg.get("attention_bias", False)),
            # V2 always rotates adjacent pairs; V3 says so in `rope_interleave` (default true)
            rope_interleave=cfg.get("model_type") != "deepseek_v3" or bool(cfg.get("rope_interleave", True)),
            scale=mla_softmax_scale(cfg),
        )
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            num_layers=cfg["num_hidden_layers"],
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            moe_layer_freq=cfg.get("moe_layer_freq") or 1,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            routing=deepseek_routing(cfg) if cfg.get("n_routed_experts") else None,
            mla=mla,
            rms_norm_eps=eps,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8_block=fp8_block_size(cfg),
        )

    def is_moe_layer(self, i: int) -> bool:
        return self.routing is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def _feed_forward(args: DeepseekArgs, i: int, dtype: torch.dtype) -> nn.Module:
    if not args.is_moe_layer(i):
        return SwiGLUMLP(args.hidden_size, args.intermediate_size, dtype=dtype)
    shared = args.moe_intermediate_size * args.n_shared_experts
    return SparseMoeBlock(
        args.routing, args.hidden_size, args.moe_intermediate_size, dtype, shared, fp8_block=args.fp8_block
    )


class DeepseekModel(nn.Module):
    def __init__(self, args: DeepseekArgs, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(MLAAttention(args.mla, dtype), _feed_forward(args, i, dtype), args.hidden_size,
                         args.rms_norm_eps, dtype)
            for i in range(args.num_layers)
        )  # fmt: skip
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)
        self.rotary_emb = get_rope(hf_config, args.mla.qk_rope_head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one [num_blocks, block_size, L + R] latent cache per layer
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb(positions)  # cos, sin: [T, R/2]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 / V2 causal LM over a paged latent (MLA) cache."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        hf_config = normalize_hf_config(hf_config)
        self.args = DeepseekArgs.from_hf(hf_config)
        self.model = DeepseekModel(self.args, hf_config, dtype)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False, dtype=dtype)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_kv_cache_layers = self.args.num_layers
        self.max_positions = self.model.rotary_emb.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H]
        return self.model(input_ids, positions, kv_caches, attn_meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head(hidden).float()

    def kv_cache_block_shape(self, block_size: int) -> tuple[int, ...]:
        return self.model.layers[0].self_attn.kv_cache_block_shape(block_size)

    def _rename(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return None  # the embedding is the head
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer >= self.args.num_layers:
                return None  # multi-token-prediction layers: not used for decoding here
        return name

    def keeps_fp8(self, name: str) -> bool:
        """From an FP8 checkpoint, the routed experts' weights stay FP8 (the rest is dequantized)."""
        return self.args.fp8_block is not None and ".mlp.experts." in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_name(self, weights, self._rename)

    def weight_filter(self):
        """The checkpoint tensors this model reads (an expert-parallel rank: its own experts only)."""
        return expert_filter(self, self._rename)

    def expected_weight_names(self) -> list[str]:
        return expected_weight_names(self)
