"""Paged decode attention for GQA with split-KV (flash-decoding).

One program per (sequence, KV head, split): the query heads that share the KV head are the
rows of one matrix, so each K/V tile is read once for the whole group. A sequence's context
is cut into `num_splits` equal ranges of its own length; the splits' partial results are
merged by `split_kv.merge_splits`. The grid depends only on (batch, KV heads, splits), and
the splits only on the block-table width, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import dot, ieee, next_pow2, sm_count, small_tiles
from deepinfer_kernels.triton_impl.split_kv import choose_num_splits, merge_splits

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    WRITE_LSE: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    heads = kvh * GROUP + rows
    q_mask = (rows[:, None] < GROUP) & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        base = page * stride_cb + (offs_n % PAGE) * stride_cs + head_off
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = (
            dot(q, tl.trans(k.to(q.dtype)), tl.zeros([GROUP_PAD, BLOCK_N], tl.float32), IEEE) * qk_scale
        )  # [G, N], log2 units
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], IEEE)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=rows < GROUP)


def default_config(head_dim: int, group: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles measured on an H200 (docs/benchmarks.md, "Kernels"); fp32 (numerics tests) gets small ones."""
    if small_tiles():
        return {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


CANDIDATES = [
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    B, hq, d = query.shape
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = hq // hkv
    out = torch.empty_like(query)
    if B == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    cfg = config or default_config(d, group, query.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(B * hkv, block_tables.shape[1] * page, sm_count(query.device), per_sm=2)
    if num_splits > 1:
        part_o = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((B, hq, num_splits), dtype=torch.float32, device=query.device)
        o, o_strides, lse, lse_strides = part_o, part_o.stride()[:3], part_lse, part_lse.stride()[:2]
    else:
        o, o_strides, lse, lse_strides = out, (*out.stride()[:2], 0), out, (0, 0)
    _decode_kernel[(B, hkv, num_splits)](
        query, kv_cache, block_tables, seq_lens, o, lse,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), *o_strides, *lse_strides, scale * LOG2E,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=d, D_PAD=max(16, next_pow2(d)), PAGE=page,
        BLOCK_N=cfg["BLOCK_N"], num_splits=num_splits, WRITE_LSE=num_splits > 1, IEEE=ieee(query), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(part_o, part_lse, out)
    return out
