"""The second pass of split-KV (flash-decoding) attention: merge each split's partial output.

Every split s of a (sequence, head) wrote its output normalised over its own keys,
`part_o[b, h, s]`, and the base-2 log-sum-exp of its scores, `part_lse[b, h, s]` (-inf for
a split with no keys). The merge weighs each split by exp2(lse_s - max lse).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, next_pow2


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    DV,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    offs = tl.arange(0, BLOCK_D)
    smask = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + splits, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    w = w / tl.sum(w, axis=0)
    mask = smask[:, None] & (offs[None, :] < DV)
    o = tl.load(
        part_o_ptr + b * stride_pb + h * stride_ph + splits[:, None] * stride_ps + offs[None, :], mask=mask, other=0.0
    )
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs, out.to(out_ptr.dtype.element_ty), mask=offs < DV)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """part_o [B, H, S, Dv] fp32, part_lse [B, H, S] fp32 -> out [B, H, Dv]."""
    B, H, S, dv = part_o.shape
    _merge_splits_kernel[(B, H)](
        part_o, part_lse, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), dv, NUM_SPLITS=S, SPLITS_PAD=next_pow2(S), BLOCK_D=next_pow2(dv),
        num_warps=4,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)  # called per layer and step with the same few shapes
def choose_num_splits(
    programs: int, max_context: int, sm_count: int, per_sm: int = 1, min_tokens: int = 256, max_splits: int = 16
) -> int:
    """Splits per (sequence, head block) for a grid of `programs` (before splitting), when
    `per_sm` programs fit on a multiprocessor at once: the fewest splits that minimise
    waves / splits (the time of one split's share), never below `min_tokens` keys a split."""
    limit = max(1, min(max_splits, cdiv(max_context, min_tokens)))
    best, best_cost = 1, float("inf")
    for s in range(1, limit + 1):
        cost = cdiv(programs * s, sm_count * per_sm) / s
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best
