"""Fused MoE: the pure-torch references of routing, permutation and the expert GEMMs.

Layouts the model side packs its experts into (HF checkpoints hold gate/up/down per expert):
- `w13 [E, 2I, H]`: rows 0..I-1 are gate_proj, rows I..2I-1 up_proj (both [I, H] as in HF);
- `w2 [E, H, I]`: down_proj.

Routing (`moe_topk`) follows HF:
- Qwen2/3-MoE: `scoring="softmax"`, top-k of the softmax probabilities, `renormalize` =
  `norm_topk_prob`;
- DeepSeek-V3: `scoring="sigmoid"`, `correction_bias=e_score_correction_bias`, `num_groups=n_group`,
  `topk_groups=topk_group` (a group's score is the sum of its two best biased scores; only the
  chosen groups' experts compete), weights are the unbiased scores of the chosen experts,
  renormalised, times `routed_scaling_factor`;
- DeepSeek-V2 grouped (`scoring="softmax"` with groups): a group's score is its best score.

`moe_align` is the permutation: the T*k (token, choice) rows sorted by expert into blocks of
`block_m` rows, each block one expert's; the Triton kernels run over it. `fused_experts` is
sum_k w_k * down(silu(gate(x)) * up(x)) with expert ids[t, k]; `fused_moe` = routing + experts.
The model side (`deepinfer_core/models/layers/moe.py`: `select_experts`, `FusedExperts` with
`w13_weight`/`w2_weight`) uses the same layouts; `fused_experts` replaces its per-expert loop
where all experts are local, and runs per rank on the received rows under expert parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_kernels.fp8 import dequantize_block_fp8, dequantize_gate_up


def moe_topk_ref(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    *,
    renormalize: bool = True,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    correction_bias: torch.Tensor | None = None,  # [E]
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int32 (best first)
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, num_groups, E // num_groups)
        if scoring == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep_groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def moe_align_ref(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, each expert's rows padded to a multiple of `block_m`.

    Returns:
        sorted_ids [max_rows] int32: flat (token * k + choice) row per slot; T*k marks padding.
        expert_ids [max_rows // block_m] int32: the expert of each block; -1 past the end.
        num_padded [1] int32: the padded row count (the used prefix of `sorted_ids`).
    `max_rows` = T*k + min(E, T*k) * (block_m - 1) rounded down to block_m: a bound known
    without reading the ids, so the shapes are fixed for a given (T, k, E).
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    N = flat.numel()
    max_rows = (N + min(num_experts, N) * (block_m - 1)) // block_m * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # rows by expert, in row order within one
    rank = torch.arange(N, device=dev) - (counts.cumsum(0) - counts)[flat[order]]
    sorted_ids = torch.full((max_rows,), N, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[flat[order]] + rank] = order.to(torch.int32)
    blocks = torch.arange(max_rows // block_m, device=dev)
    expert_ids = torch.searchsorted(ends // block_m, blocks, right=True)
    total = ends[-1:] if N else torch.zeros(1, dtype=torch.long, device=dev)
    expert_ids = torch.where(blocks * block_m < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


def fused_experts_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int
    *,
    w13_scale: torch.Tensor | None = None,  # FP8 weights: block factors (deepinfer_kernels.fp8)
    w2_scale: torch.Tensor | None = None,
    fp8_block: tuple[int, int] = (128, 128),
) -> torch.Tensor:  # [T, H]
    """Rows sorted by expert, one GEMM pair per expert (one host sync for the counts).

    Roundings are the Triton kernel's (and HF's eager experts'): the GEMMs' outputs and silu in
    the activation dtype, each expert's output times its fp32 weight rounded to the activation
    dtype, the k rows summed in fp32. FP8 weights are dequantized per expert to the activation
    dtype (value x block factor, rounded once), as the kernel dequantizes its tiles."""
    T, k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tokens = order // k
    x = hidden[tokens]  # [T*k, H] in expert order
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        w13e, w2e = w13[e], w2[e]
        if w13_scale is not None:
            w13e = dequantize_gate_up(w13e, w13_scale[e], fp8_block, hidden.dtype)
            w2e = dequantize_block_fp8(w2e, w2_scale[e], fp8_block, hidden.dtype)
        gate_up = x[rows] @ w13e.t()  # [n, 2I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ w2e.t()).float() * topk_weights.reshape(-1)[order[rows]].float()[:, None]
        out.index_add_(0, tokens[rows], y.to(hidden.dtype).float())
        start += n
    return out.to(hidden.dtype)


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    **routing,
) -> torch.Tensor:
    """Route (`moe_topk_ref` with `routing` options) then run the experts."""
    weights, ids = moe_topk_ref(router_logits, top_k, **routing)
    return fused_experts_ref(hidden, w13, w2, weights, ids)
