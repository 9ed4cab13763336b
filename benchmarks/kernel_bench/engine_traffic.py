"""The bytes a decode step moves and the FLOPs a prefill does, read off the engine's model (and,
for the routed experts, off one eagerly run step)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def count_routed_experts(engine, batch: int) -> Optional[list[int]]:
    """Distinct experts per MoE layer in one eagerly run decode step of `batch` tokens (None when no
    such forward ran). A forward pre-hook on each SparseMoeBlock recomputes the block's routing."""
    from deepinfer_core.models.layers.moe import SparseMoeBlock, select_experts

    blocks = [m for m in engine.worker.model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return []
    seen: dict[int, int] = {}

    def hook(module: SparseMoeBlock, args: tuple) -> None:
        x = args[0]
        if x.shape[0] != batch or id(module) in seen:
            return
        bias = getattr(module.gate, "e_score_correction_bias", None)
        _, ids = select_experts(module.router_logits(x), module.routing, bias)
        seen[id(module)] = int(torch.unique(ids).numel())

    handles = [b.register_forward_pre_hook(hook) for b in blocks]
    runner = engine.worker.runner
    graphs, runner.graphs = runner.graphs, None  # graph replays run no Python: this step runs eagerly
    try:
        for _ in range(2):  # a second step in case the first one's forward was launched before
            if len(seen) == len(blocks) or not engine.has_unfinished_requests():
                break
            engine.step()
    finally:
        runner.graphs = graphs
        for h in handles:
            h.remove()
    return [seen[id(b)] for b in blocks] if len(seen) == len(blocks) else None


# ---- bytes and FLOPs ---------------------------------------------------------------------------
def model_bytes(model: nn.Module, block_size: int = 16) -> dict[str, Any]:
    """The byte counts a decode step's traffic is made of, read off the engine's model."""
    from deepinfer_core.models.layers.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    stacked = {id(p) for b in blocks for p in (b.experts.w13_weight, b.experts.w2_weight)}
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
    untied = {id(w) for w in embeddings if w is not lm_head}
    dense = sum(p.nbytes for p in model.parameters() if id(p) not in stacked and id(p) not in untied)
    per_expert = [b.experts.w13_weight[0].nbytes + b.experts.w2_weight[0].nbytes for b in blocks]
    shape = model.kv_cache_block_shape(block_size)
    itemsize = next(model.parameters()).element_size()
    return {
        "total": sum(p.nbytes for p in model.parameters()),
        "dense": dense,
        "embedding_row": sum(w[0].nbytes for w in embeddings if id(w) in untied),
        "per_expert": per_expert,
        "num_experts": [b.experts.num_experts for b in blocks],
        "top_k": [b.routing.top_k for b in blocks],
        "kv_per_token": model.num_kv_cache_layers * math.prod(shape) // block_size * itemsize,
        "itemsize": itemsize,
    }


def step_weight_bytes(mb: dict[str, Any], unique: list[int], batch: int) -> int:
    """Weights one decode step reads: dense in full, `batch` embedding rows, the routed-to experts."""
    return mb["dense"] + batch * mb["embedding_row"] + sum(u * e for u, e in zip(unique, mb["per_expert"]))


def prefill_flops(mb: dict[str, Any], hf_config: dict[str, Any], tokens: int) -> float:
    """2 x active weights per token (dense minus lm_head, which runs for the last token only, plus
    top-k experts per MoE layer) + causal attention 4 * heads * head_dim * visible pairs per layer."""
    vocab, hidden = hf_config["vocab_size"], hf_config["hidden_size"]
    lm_head_params = vocab * hidden
    dense_params = mb["dense"] / mb["itemsize"] - lm_head_params
    expert_params = sum(k * e / mb["itemsize"] for k, e in zip(mb["top_k"], mb["per_expert"]))
    visible = tokens * (tokens + 1) / 2
    attn = 4 * hf_config["num_attention_heads"] * hf_config["head_dim"] * visible * hf_config["num_hidden_layers"]
    return 2 * tokens * (dense_params + expert_params) + 2 * lm_head_params + attn
