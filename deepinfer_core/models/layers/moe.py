"""Mixture-of-experts feed-forward: routing, token permutation, per-expert matmuls, combine.

One MoE step, written so that expert parallelism only has to add the all-to-all:

    route      router logits [T, E] -> top-k expert ids and weights per token  (`select_experts`)
    permute    token copies sorted by expert: [T*k, H] plus per-expert counts   (`permute`)
    (EP: all-to-all dispatch of the permuted rows to the ranks owning the experts)
    experts    one SwiGLU matmul pair per *local* expert over its contiguous rows (`FusedExperts`,
               a grouped GEMM over all experts at once where torch provides one)
    (EP: all-to-all combine back to the source ranks)
    unpermute  weighted sum of each token's k expert outputs                    (`unpermute`)

`FusedExperts` holds the local experts' weights stacked as `w13_weight [E_local, 2I, H]`
(gate rows then up rows) and `w2_weight [E_local, H, I]`, the layout a grouped GEMM takes
(from an FP8 checkpoint: e4m3 values plus `*_weight_scale_inv` block factors, see `deepinfer_kernels.fp8`);
checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight` (Mixtral: w1, w3, w2) are copied
into their slices by `load_expert`. With every expert local (no EP) `local_experts` is all of
them. This is the torch reference; on CUDA, with every expert local, `deepinfer_kernels.ops.fused_experts`
(the Triton fused-MoE kernel, same weight layout) runs the experts instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.models.layers.mlp import SwiGLUMLP
from deepinfer_kernels import ops
from deepinfer_kernels.fp8 import FP8_DTYPE, dequantize_block_fp8, dequantize_gate_up
from deepinfer_kernels.registry import use_triton

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# checkpoint projection name -> (stacked parameter, shard: 0 gate rows, 1 up rows, None whole)
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13_weight", 0),
    "w1": ("w13_weight", 0),
    "up_proj": ("w13_weight", 1),
    "w3": ("w13_weight", 1),
    "down_proj": ("w2_weight", None),
    "w2": ("w2_weight", None),
}


@dataclass(frozen=True)
class RoutingConfig:
    """How a router turns logits into each token's experts and weights."""

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"  # "softmax" (Mixtral, Qwen-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2: group score = max), "noaux_tc" (V3)
    n_group: int = 1  # expert groups for the group-limited methods
    topk_group: int = 1  # groups each token may use
    norm_topk_prob: bool = False  # renormalise the k weights to sum to one
    routed_scaling_factor: float = 1.0  # multiplies the final weights
    router_fp32: bool = False  # router matmul in fp32 with an fp32 gate weight (DeepSeek)
    weights_in_activation_dtype: bool = False  # cast weights back to the activation dtype (Qwen3-MoE)

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r}; supported: {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported MoE topk_method {self.topk_method!r}; supported: {TOPK_METHODS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"{self.num_experts} experts cannot form n_group={self.n_group} groups with topk_group={self.topk_group}"
            )


def _group_mask(choice: torch.Tensor, cfg: RoutingConfig, group_score: str) -> torch.Tensor:
    """[T, E] bool: experts in each token's `topk_group` best groups."""
    T = choice.shape[0]
    grouped = choice.view(T, cfg.n_group, cfg.num_experts // cfg.n_group)  # [T, G, E/G]
    if group_score == "max":
        scores = grouped.max(dim=-1).values
    else:  # sum of the two best experts of the group
        scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
    best = torch.topk(scores, k=cfg.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    mask = torch.zeros_like(scores).scatter_(1, best, 1.0)  # [T, G]
    return mask.unsqueeze(-1).expand_as(grouped).reshape(T, cfg.num_experts).bool()


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,  # [E]: added for choosing only (noaux_tc)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts: (weights [T, k] fp32, expert ids [T, k] int64).

    Selection follows the reference implementations op for op (the same `topk` calls on the same
    tensors), so ties between equal scores resolve to the same experts.
    """
    if cfg.scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    else:
        scores = router_logits.float().sigmoid()
    if cfg.topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias.float()
        choice = choice.masked_fill(~_group_mask(choice, cfg, "top2_sum"), float("-inf"))
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    elif cfg.topk_method == "group_limited_greedy":
        masked = scores.masked_fill(~_group_mask(scores, cfg, "max"), 0.0)
        weights, ids = torch.topk(masked, k=cfg.top_k, dim=-1, sorted=False)
    else:
        weights, ids = torch.topk(scores, k=cfg.top_k, dim=-1, sorted=False)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


@dataclass
class PermutedTokens:
    """Token copies grouped by expert: local expert e owns the e-th run of `counts[e]` rows."""

    hidden: torch.Tensor  # [N, H]: one row per (token, chosen local expert), sorted by expert
    token_index: torch.Tensor  # [N] int64: source token of each row
    weights: torch.Tensor  # [N] fp32: routing weight of each row
    counts: list[int] | torch.Tensor  # rows per local expert (E_local entries; host copy, or on the device)


def permute(
    hidden: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] global expert ids
    local_experts: range,  # global ids this rank holds
) -> PermutedTokens:
    """Copies of each token for its chosen local experts, sorted by (local expert, token)."""
    T, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    local = (flat_ids >= local_experts.start) & (flat_ids < local_experts.stop)
    local_ids = flat_ids[local] - local_experts.start
    order = torch.argsort(local_ids, stable=True)  # stable: token order inside each expert
    token_index = torch.arange(T, device=hidden.device).repeat_interleave(k)[local][order]
    counts = torch.bincount(local_ids, minlength=len(local_experts)).tolist()
    return PermutedTokens(hidden[token_index], token_index, weights.reshape(-1)[local][order], counts)


def unpermute(expert_out: torch.Tensor, perm: PermutedTokens, num_tokens: int) -> torch.Tensor:
    """[N, H] expert outputs -> [T, H]: each token's weighted sum over its experts.

    Rows arrive sorted by expert, so each token's terms are added in expert order, as a
    per-expert loop would add them.
    """
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device)
    weighted = (expert_out * perm.weights[:, None]).to(expert_out.dtype)
    return out.index_add_(0, perm.token_index, weighted)


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    return hasattr(F, "grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert times each group's expert matrix: x [N, K] (rows of expert e are the
    e-th run of `counts`), weight [E, Out, K] -> [N, Out]. One grouped GEMM where torch has it,
    else one GEMM per expert. `counts` on the device (a padded dispatch's) is not read back for
    the grouped GEMM; rows past the last group (padding) come out as zeros."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[1])
    if _grouped_mm_usable(x):
        ends = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x.device)
        offs = ends.to(x.device).cumsum(0).to(torch.int32)  # end row of each group
        out = F.grouped_mm(x, weight.transpose(1, 2), offs=offs)
        if isinstance(counts, torch.Tensor):  # padding rows: left undefined by the grouped GEMM
            out = out.masked_fill(torch.arange(x.shape[0], device=x.device)[:, None] >= offs[-1], 0)
        return out
    if isinstance(counts, torch.Tensor):  # on the device: never read back (a CUDA graph captures this)
        return _masked_linear(x, weight, counts.to(x.device))
    out = (
        x.new_zeros(x.shape[0], weight.shape[1])
        if sum(counts) < x.shape[0]
        else x.new_empty(x.shape[0], weight.shape[1])
    )
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(x[start : start + n], weight[e])
        start += n
    return out


def _masked_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` with the group sizes on the device and no grouped GEMM: every expert's
    matrix over all rows, each row keeping its own expert's result (padding rows: zeros). E times
    the FLOPs of the grouped GEMM, but static shapes and no read-back."""
    expert_of = torch.searchsorted(counts.cumsum(0), torch.arange(x.shape[0], device=x.device), right=True)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        out = torch.where((expert_of == e)[:, None], F.linear(x, weight[e]), out)
    return out


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


_BUILD_SLOTS: ContextVar[list[int] | None] = ContextVar("expert_slots", default=None)


@contextmanager
def building_local_experts(slots: list[int] | None) -> Iterator[None]:
    """Every `FusedExperts` built inside holds only `slots` (an expert-parallel rank's logical expert
    per local slot) unless told otherwise: a rank allocates its shard of the experts, never all."""
    token = _BUILD_SLOTS.set(list(slots) if slots is not None else None)
    try:
        yield
    finally:
        _BUILD_SLOTS.reset(token)


class FusedExperts(nn.Module):
    """The local routed experts' SwiGLU weights, stacked per expert.

    `fp8_block=(bn, bk)`: the weights stay as an FP8 checkpoint stores them (e4m3 plus one fp32
    factor per [bn, bk] block: `w13_weight_scale_inv [E, 2 * ceil(I / bn), ceil(H / bk)]`, gate's
    factors then up's, and `w2_weight_scale_inv [E, ceil(H / bn), ceil(I / bk)]`): half the memory
    and half the bytes a decode step reads. The fused kernel reads them as stored; the torch path
    dequantizes them per call."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        local_experts: range | list[int] | None = None,
        hidden_act: str = "silu",
        fp8_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"MoE experts need hidden_act='silu', got {hidden_act!r}")
        self.num_experts = num_experts
        if local_experts is None:
            local_experts = _BUILD_SLOTS.get()
        self.local_experts = local_experts if local_experts is not None else range(num_experts)
        """Logical expert of each local slot: all of them in order, or an expert-parallel rank's slots
        (a list, repeats allowed with redundant experts)."""
        self.intermediate_size = intermediate_size
        self.fp8_block = tuple(fp8_block) if fp8_block else None
        n = len(self.local_experts)
        wdtype = FP8_DTYPE if self.fp8_block else dtype
        frozen = {"requires_grad": False} if self.fp8_block else {}
        self.w13_weight = nn.Parameter(torch.empty(n, 2 * intermediate_size, hidden_size, dtype=wdtype), **frozen)
        self.w2_weight = nn.Parameter(torch.empty(n, hidden_size, intermediate_size, dtype=wdtype), **frozen)
        if self.fp8_block:
            bn, bk = self.fp8_block
            i_n, h_n, i_k, h_k = (_blocks(intermediate_size, bn), _blocks(hidden_size, bn),
                                  _blocks(intermediate_size, bk), _blocks(hidden_size, bk))  # fmt: skip
            self.w13_weight_scale_inv = nn.Parameter(torch.empty(n, 2 * i_n, h_k), requires_grad=False)
            self.w2_weight_scale_inv = nn.Parameter(torch.empty(n, h_n, i_k), requires_grad=False)

    def fp8_kwargs(self) -> dict:
        """What `deepinfer_kernels.ops.fused_experts` needs besides the weights: the FP8 factors, or nothing."""
        if not self.fp8_block:
            return {}
        return dict(w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv, fp8_block=self.fp8_block)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fp8_block:
            return self.w13_weight, self.w2_weight
        w13 = dequantize_gate_up(self.w13_weight, self.w13_weight_scale_inv, self.fp8_block, dtype)
        return w13, dequantize_block_fp8(self.w2_weight, self.w2_weight_scale_inv, self.fp8_block, dtype)

    def forward(self, perm: PermutedTokens) -> torch.Tensor:  # [N, H] -> [N, H]
        w13, w2 = self._weights(perm.hidden.dtype)
        gate, up = grouped_linear(perm.hidden, w13, perm.counts).chunk(2, dim=-1)  # [N, I] each
        return grouped_linear(F.silu(gate) * up, w2, perm.counts)

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, scale: bool = False) -> bool:
        """Copy one checkpoint expert tensor (`scale`: its FP8 `weight_scale_inv`) into its slice;
        False when the expert is not local."""
        slots = [i for i, e in enumerate(self.local_experts) if e == expert]
        if not slots:
            return False
        if scale and not self.fp8_block:
            raise ValueError(f"expert {expert} {projection} has FP8 factors, but these experts are not FP8")
        param_name, shard = EXPERT_PROJECTIONS[projection]
        for slot in slots:
            target = getattr(self, param_name + ("_scale_inv" if scale else ""))[slot]
            if shard is not None:
                rows = target.shape[0] // 2 if scale else self.intermediate_size
                target = target[shard * rows : (shard + 1) * rows]
            if target.shape != tensor.shape:
                what = f"{projection} weight_scale_inv" if scale else projection
                raise ValueError(
                    f"expert {expert} {what} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
        return True

    def checkpoint_names(self, prefix: str) -> list[str]:
        """Checkpoint names of the local experts' tensors, spelled `{prefix}.{e}.{gate,up,down}_proj.weight`
        (and `.weight_scale_inv` for FP8 experts)."""
        kinds = ("weight", "weight_scale_inv") if self.fp8_block else ("weight",)
        return [f"{prefix}.{e}.{p}.{kind}" for e in sorted(set(self.local_experts)) for p in ("gate_proj", "up_proj", "down_proj")
                for kind in kinds]  # fmt: skip


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ optional always-on shared experts), named as HF checkpoints name them:
    `gate.weight` [E, H], `gate.e_score_correction_bias` [E] (noaux_tc), `experts.*`, `shared_experts.*`."""

    def __init__(
        self,
        routing: RoutingConfig,
        hidden_size: int,
        moe_intermediate_size: int,
        dtype: torch.dtype,
        shared_intermediate_size: int = 0,
        local_experts: range | None = None,
        fp8_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.routing = routing
        self.gate = nn.Linear(
            hidden_size, routing.num_experts, bias=False, dtype=torch.float32 if routing.router_fp32 else dtype
        )
        if routing.topk_method == "noaux_tc":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(routing.num_experts, dtype=torch.float32))
        self.experts = FusedExperts(
            routing.num_experts, hidden_size, moe_intermediate_size, dtype, local_experts, fp8_block=fp8_block
        )
        self.shared_experts = (
            SwiGLUMLP(hidden_size, shared_intermediate_size, dtype=dtype) if shared_intermediate_size else None
        )
        self.ep = None
        """Expert parallelism (`deepinfer_core.distributed.expert_parallel.ExpertParallelMoE`), set from
        outside: runs the routed experts across the instance's ranks. None: every expert is local."""

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        if self.routing.router_fp32:
            return F.linear(x.float(), self.gate.weight.float())
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = select_experts(self.router_logits(x), self.routing, bias)  # [T, k] each
        if self.routing.weights_in_activation_dtype:
            weights = weights.to(x.dtype)
        experts = self.experts
        if self.ep is not None:
            out = self.ep(x, weights, ids, experts)
        elif use_triton(x) and len(experts.local_experts) == experts.num_experts:  # CUDA: the fused kernel
            out = ops.fused_experts(
                x, experts.w13_weight, experts.w2_weight, weights, ids.to(torch.int32), **experts.fp8_kwargs()
            ).to(x.dtype)
        else:
            perm = permute(x, weights, ids, experts.local_experts)
            out = unpermute(experts(perm), perm, x.shape[0])  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
