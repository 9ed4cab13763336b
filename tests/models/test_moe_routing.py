"""MoE routing and dispatch against transformers' routers, on random router logits with many ties.

Logits are drawn from a handful of values, so equal scores are common (inside a group, across
groups, at the top-k boundary); the chosen experts and weights must equal HF's regardless.
"""

from __future__ import annotations

import pytest
import torch
import transformers
import transformers.models.deepseek_v2.modeling_deepseek_v2 as hf_v2
import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf_v3
import transformers.models.mixtral.modeling_mixtral as hf_mixtral
import transformers.models.qwen3_moe.modeling_qwen3_moe as hf_qwen3

from deepinfer_core.models.deepseek_v3 import deepseek_routing
from deepinfer_core.models.layers.moe import (
    FusedExperts,
    RoutingConfig,
    SparseMoeBlock,
    permute,
    select_experts,
    unpermute,
)
from deepinfer_core.models.qwen3_moe import moe_routing
from deepinfer_kernels import ops

E, T = 16, 64


def _tied_logits(seed: int, levels: int = 4) -> torch.Tensor:
    """[T, E] logits taking only `levels` distinct values: ties everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (T, E), generator=g).float() / levels - 0.5


def _identity_router(router: torch.nn.Module) -> torch.nn.Module:
    """An HF router whose logits are its input (hidden size = E, weight = identity)."""
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's (id, weight) pairs by expert id, so unordered top-k results compare."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _assert_same_choice(ours: tuple[torch.Tensor, torch.Tensor], ref_weights, ref_ids) -> None:
    ours_ids, ours_w = _by_expert(ours[0], ours[1])
    ref_ids, ref_w = _by_expert(ref_weights.float(), ref_ids.long())
    assert torch.equal(ours_ids, ref_ids)
    torch.testing.assert_close(ours_w, ref_w, atol=1e-6, rtol=0)


DEEPSEEK_V3_CASES = {
    "groups": dict(n_group=4, topk_group=2, num_experts_per_tok=4),
    "one_group": dict(n_group=1, topk_group=1, num_experts_per_tok=6),
    "groups_no_renorm": dict(n_group=8, topk_group=3, num_experts_per_tok=2, norm_topk_prob=False),
}


@pytest.mark.parametrize("case", list(DEEPSEEK_V3_CASES))
@pytest.mark.parametrize("bias", ["zero", "tied", "random"])
def test_deepseek_v3_grouped_topk_equals_hf(case: str, bias: str) -> None:
    config = transformers.DeepseekV3Config(
        hidden_size=E, n_routed_experts=E, routed_scaling_factor=2.5, **DEEPSEEK_V3_CASES[case]
    )
    router = _identity_router(hf_v3.DeepseekV3TopkRouter(config))
    g = torch.Generator().manual_seed(7)
    correction = {
        "zero": torch.zeros(E),
        "tied": torch.randint(0, 2, (E,), generator=g).float() / 8,
        "random": torch.randn(E, generator=g) * 0.1,
    }[bias]
    router.e_score_correction_bias.copy_(correction)
    routing = deepseek_routing(config.to_dict())
    for seed in range(4):
        logits = _tied_logits(seed)
        _, ref_w, ref_ids = router(logits)
        _assert_same_choice(select_experts(logits, routing, correction), ref_w, ref_ids)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_topk_equals_hf(method: str) -> None:
    config = transformers.DeepseekV2Config(
        hidden_size=E, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=3, topk_method=method,
        n_group=4, topk_group=2, routed_scaling_factor=1.5,
    )  # fmt: skip
    router = _identity_router(hf_v2.DeepseekV2TopkRouter(config))
    routing = deepseek_routing(config.to_dict())
    assert routing.scoring_func == "softmax" and not routing.norm_topk_prob
    for seed in range(4):
        logits = _tied_logits(seed, levels=3)
        _, ref_w, ref_ids = router(logits)
        _assert_same_choice(select_experts(logits, routing), ref_w, ref_ids)


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_softmax_topk_equals_hf(family: str, norm: bool) -> None:
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=4, norm_topk_prob=norm)
        router = _identity_router(hf_qwen3.Qwen3MoeTopKRouter(config))
    else:  # Mixtral always renormalises
        config = transformers.MixtralConfig(hidden_size=E, num_local_experts=E, num_experts_per_tok=4)
        router = _identity_router(hf_mixtral.MixtralTopKRouter(config))
    routing = moe_routing(config.to_dict())
    for seed in range(4):
        logits = _tied_logits(seed)
        _, ref_w, ref_ids = router(logits)
        _assert_same_choice(select_experts(logits, routing), ref_w, ref_ids)


def _dense_reference(x, weights, ids, experts: FusedExperts) -> torch.Tensor:
    """sum_k w_k * expert_{id_k}(x) token by token, no permutation."""
    out = torch.zeros_like(x)
    inter = experts.intermediate_size
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            w13, w2 = experts.w13_weight[e], experts.w2_weight[e]
            h = torch.nn.functional.silu(x[t] @ w13[:inter].T) * (x[t] @ w13[inter:].T)
            out[t] += w * (h @ w2.T)
    return out


def _random_experts(num: int, local: range | None = None, seed: int = 0) -> FusedExperts:
    experts = FusedExperts(num, 12, 20, torch.float32, local)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        full13, full2 = torch.randn(num, 40, 12, generator=g) * 0.3, torch.randn(num, 12, 20, generator=g) * 0.3
        experts.w13_weight.copy_(full13[experts.local_experts.start : experts.local_experts.stop])
        experts.w2_weight.copy_(full2[experts.local_experts.start : experts.local_experts.stop])
    return experts


def test_permute_experts_unpermute_equals_dense_reference() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 12, generator=g)
    routing = RoutingConfig(num_experts=8, top_k=3, norm_topk_prob=True)
    weights, ids = select_experts(torch.randn(T, 8, generator=g), routing)
    experts = _random_experts(8)
    perm = permute(x, weights, ids, experts.local_experts)
    assert perm.hidden.shape == (T * 3, 12) and sum(perm.counts) == T * 3
    assert torch.equal(perm.hidden, x[perm.token_index])
    expert_of_row = torch.repeat_interleave(torch.arange(8), torch.tensor(perm.counts))
    assert bool((expert_of_row[1:] >= expert_of_row[:-1]).all())  # rows grouped by expert
    out = unpermute(experts(perm), perm, T)
    torch.testing.assert_close(out, _dense_reference(x, weights, ids, experts), atol=1e-5, rtol=0)


def test_local_expert_shards_sum_to_the_full_layer() -> None:
    """Expert parallelism's contract: each rank computes only its local experts' share; the
    shares of a partition of the experts add up to the full layer's output."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, 12, generator=g)
    weights, ids = select_experts(torch.randn(T, 8, generator=g), RoutingConfig(num_experts=8, top_k=2))
    full = _random_experts(8)
    perm = permute(x, weights, ids, full.local_experts)
    want = unpermute(full(perm), perm, T)
    shares = []
    for local in (range(0, 3), range(3, 8)):
        shard = _random_experts(8, local)
        p = permute(x, weights, ids, local)
        assert sum(p.counts) == int(((ids >= local.start) & (ids < local.stop)).sum())
        shares.append(unpermute(shard(p), p, T))
    torch.testing.assert_close(shares[0] + shares[1], want, atol=1e-5, rtol=0)


def test_expert_loading_fills_local_slices_only() -> None:
    experts = FusedExperts(4, 3, 2, torch.float32, local_experts=range(2, 4))
    gate, up, down = torch.full((2, 3), 1.0), torch.full((2, 3), 2.0), torch.full((3, 2), 3.0)
    assert experts.load_expert(3, "gate_proj", gate) and experts.load_expert(3, "w3", up)
    assert experts.load_expert(3, "down_proj", down)
    assert not experts.load_expert(0, "gate_proj", gate)  # another rank's expert
    assert torch.equal(experts.w13_weight[1], torch.cat([gate, up]))
    assert torch.equal(experts.w2_weight[1], down)
    with pytest.raises(ValueError, match="expert 2 up_proj has shape"):
        experts.load_expert(2, "up_proj", torch.zeros(3, 3))
    assert experts.checkpoint_names("m.experts")[:3] == [
        "m.experts.2.gate_proj.weight",
        "m.experts.2.up_proj.weight",
        "m.experts.2.down_proj.weight",
    ]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scoring_func="relu"), "scoring_func 'relu'"),
        (dict(topk_method="sinkhorn"), "topk_method 'sinkhorn'"),
        (dict(top_k=9), "num_experts_per_tok=9"),
        (dict(n_group=3, topk_group=1, topk_method="noaux_tc"), "n_group=3"),
    ],
)
def test_bad_routing_configs_are_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**{"num_experts": 8, "top_k": 2, **kwargs})


def test_shared_experts_are_added_to_routed_output() -> None:
    routing = RoutingConfig(num_experts=4, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    block = SparseMoeBlock(routing, 12, 20, torch.float32, shared_intermediate_size=40)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(5, 12, generator=g)
    weights, ids = select_experts(block.router_logits(x), routing, block.gate.e_score_correction_bias)
    routed = _dense_reference(x, weights, ids, block.experts)
    torch.testing.assert_close(block(x), routed + block.shared_experts(x), atol=1e-5, rtol=0)


def test_fused_moe_kernel_contract_matches_the_layer() -> None:
    """On CUDA the layer hands its stacked weights and routing to `deepinfer_kernels.ops.fused_experts`;
    that op's reference must compute what the layer's own path computes."""
    routing = RoutingConfig(num_experts=8, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    block = SparseMoeBlock(routing, 12, 20, torch.float32)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(T, 12, generator=g)
    weights, ids = select_experts(block.router_logits(x), routing, block.gate.e_score_correction_bias)
    perm = permute(x, weights, ids, block.experts.local_experts)
    want = unpermute(block.experts(perm), perm, T)
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    got = ops.fused_experts(x, w13, w2, weights, ids.to(torch.int32), backend="torch")
    torch.testing.assert_close(got.to(x.dtype), want, atol=1e-5, rtol=0)
