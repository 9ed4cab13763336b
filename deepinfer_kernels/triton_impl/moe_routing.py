"""MoE routing on the device: top-k expert choice (plain or grouped) and the permutation
that groups the (token, choice) pairs by expert in blocks of `block_m` rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, next_pow2


@triton.jit
def _topk_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    stride_l,
    scaling,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    GSIZE_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_PAD)[:, None]
    j = tl.arange(0, GSIZE_PAD)[None, :]
    e = g * GROUP_SIZE + j  # expert id of each slot of the [groups, group size] view
    valid = (g < NUM_GROUPS) & (j < GROUP_SIZE)
    x = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        p = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        m1 = tl.max(choice, axis=1)
        if SIGMOID:  # group score: sum of its two best (DeepSeek-V3)
            first = tl.min(tl.where(choice == m1[:, None], j, GSIZE_PAD), axis=1)
            m2 = tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
            gscore = m1 + m2
        else:  # group score: its best (DeepSeek-V2)
            gscore = m1
        gidx = tl.arange(0, GROUPS_PAD)
        gscore = tl.where(gidx < NUM_GROUPS, gscore, float("-inf"))
        keep = gidx < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, gidx, GROUPS_PAD), axis=0)
            keep = keep | (gidx == pick)
            gscore = tl.where(gidx == pick, float("-inf"), gscore)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == best, e, GROUPS_PAD * GSIZE_PAD), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(e == pick, scores, 0.0), axis=1), axis=0)
        weights = tl.where(kk == k, w, weights)
        ids = tl.where(kk == k, pick, ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    tl.store(w_ptr + t * TOP_K + kk, weights, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kk < TOP_K)


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    gsize = E // num_groups
    _topk_kernel[(T,)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids,
        logits.stride(0), float(routed_scaling_factor),
        NUM_GROUPS=num_groups, GROUP_SIZE=gsize, GROUPS_PAD=next_pow2(num_groups), GSIZE_PAD=next_pow2(gsize),
        TOPK_GROUPS=topk_groups, TOP_K=top_k, K_PAD=next_pow2(top_k), SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORM=renormalize, num_warps=4 if E <= 512 else 8,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, N, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=E)  # out-of-range lanes land in bin E
    hist = tl.histogram(ids, E_PAD)
    bins = tl.arange(0, E_PAD)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < E) & (hist > 0))


@triton.jit
def _offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, npad_ptr, E, max_blocks,
                    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    bins = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, ends - padded, mask=bins < E)  # each expert's first row
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    end_blocks = tl.where(bins < E, ends // BLOCK_M, 2147483647)
    for c0 in range(0, max_blocks, CHUNK):
        blk = c0 + tl.arange(0, CHUNK)
        expert = tl.sum((end_blocks[None, :] <= blk[:, None]).to(tl.int32), axis=1)
        expert = tl.where(blk * BLOCK_M < total, expert, -1)
        tl.store(expert_ids_ptr + blk, expert, mask=blk < max_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    pos = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    tl.store(sorted_ptr + pos, offs, mask=mask)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row count (a multiple of block_m), known without a sync."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return rows // block_m * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    N = ids.numel()
    max_rows = max_padded_rows(N, num_experts, block_m)
    max_blocks = max_rows // block_m
    sorted_ids = torch.full((max_rows,), N, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    npad = torch.empty((1,), dtype=torch.int32, device=dev)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=dev)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    if N == 0:
        npad.zero_()
        return sorted_ids, expert_ids, npad
    e_pad = next_pow2(num_experts + 1)
    block = 1024 if N >= 1024 else next_pow2(N)
    grid = (cdiv(N, block),)
    _count_kernel[grid](ids, counts, N, num_experts, E_PAD=e_pad, BLOCK=block)
    _offsets_kernel[(1,)](counts, cursor, expert_ids, npad, num_experts, max_blocks,
                          E_PAD=e_pad, BLOCK_M=block_m, CHUNK=32)  # fmt: skip
    _scatter_kernel[grid](ids, cursor, sorted_ids, N, BLOCK=block)
    return sorted_ids, expert_ids, npad
