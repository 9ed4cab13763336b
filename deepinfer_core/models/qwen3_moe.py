"""Qwen3-MoE and Mixtral: the Llama-family decoder with softmax top-k routed experts.

Attention is `LlamaAttention` (Qwen3-MoE adds per-head q/k RMSNorm, as Qwen3 does); the
feed-forward of each sparse layer is a `SparseMoeBlock` without shared experts. Qwen3-MoE keeps
dense MLP layers where `mlp_only_layers` or `decoder_sparse_step` say so and renormalises the
top-k weights when `norm_topk_prob` is set; Mixtral always renormalises and names its blocks
`block_sparse_moe` with experts `w1` (gate), `w3` (up), `w2` (down) — renamed on load. From a
block-FP8 checkpoint (Qwen3-30B-A3B-FP8) the routed experts stay FP8, as DeepSeek's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.moe import RoutingConfig, SparseMoeBlock
from deepinfer_core.models.llama import LlamaForCausalLM
from deepinfer_core.models.quantization import fp8_block_size
from deepinfer_core.models.weights import expected_weight_names, expert_filter, load_weights_by_name


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts per layer: `num_experts` (Qwen checkpoints) or `num_local_experts` (Mixtral,
    and Qwen3-MoE configs written by transformers 5)."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def moe_routing(cfg: dict[str, Any]) -> RoutingConfig:
    mixtral = cfg.get("model_type") == "mixtral"
    return RoutingConfig(
        num_experts=num_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        weights_in_activation_dtype=not mixtral,
    )


def sparse_layers(cfg: dict[str, Any]) -> set[int]:
    """Indices of the layers whose feed-forward is a mixture of experts."""
    n = cfg["num_hidden_layers"]
    if cfg.get("model_type") == "mixtral":
        return set(range(n))
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    return {i for i in range(n) if i not in dense and num_experts(cfg) > 0 and (i + 1) % step == 0}


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Mixtral causal LM over a paged KV cache."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        hf_config = normalize_hf_config(hf_config)
        routing, sparse = moe_routing(hf_config), sparse_layers(hf_config)
        hidden = hf_config["hidden_size"]
        width = hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]  # Mixtral: the latter

        fp8_block = fp8_block_size(hf_config)  # an FP8 checkpoint's routed experts stay FP8

        def make_mlp(i: int) -> nn.Module | None:
            return SparseMoeBlock(routing, hidden, width, dtype, fp8_block=fp8_block) if i in sparse else None

        super().__init__(hf_config, dtype, make_mlp)
        self.fp8_block = fp8_block

    def keeps_fp8(self, name: str) -> bool:
        """From an FP8 checkpoint, the routed experts' weights stay FP8 (the rest is dequantized)."""
        return self.fp8_block is not None and (".mlp.experts." in name or ".block_sparse_moe.experts." in name)

    def _rename(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return None
        return name.replace(".block_sparse_moe.", ".mlp.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_name(self, weights, self._rename)

    def weight_filter(self):
        """The checkpoint tensors this model reads (an expert-parallel rank: its own experts only)."""
        return expert_filter(self, self._rename)

    def expected_weight_names(self) -> list[str]:
        return expected_weight_names(self)
