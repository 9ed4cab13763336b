"""Causal prefill attention over a paged KV cache, with prefix hits and variable lengths.

Sequence b's new tokens are rows `query_start_loc[b]:query_start_loc[b+1]` of the flat batch
and sit at the end of its `seq_lens[b]` context; all their keys, the new ones included, are
read from the cache (write them with `reshape_and_cache` first). One program per (query
block, query head, sequence): first the key tiles every row of the block sees in full (no
mask), then the tiles along the diagonal (causal mask). Query blocks are taken longest
first, so the heavy diagonal-far blocks do not finish last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, dot, ieee, next_pow2, small_tiles

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_row, head_off, n0, offs_d, dmask, q_pos, hi,
                 stride_cb, stride_ckv, stride_cs, qk_scale,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = offs_n < hi
        page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    base = page * stride_cb + (offs_n % PAGE) * stride_cs + head_off
    k = tl.load(cache_ptr + base[:, None] + offs_d[None, :], mask=dmask[None, :], other=0.0)
    v = tl.load(cache_ptr + stride_ckv + base[:, None] + offs_d[None, :], mask=dmask[None, :], other=0.0)
    s = (
        dot(q, tl.trans(k.to(q.dtype)), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE) * qk_scale
    )  # [M, N], log2 units
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < hi)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    m_blk = tl.num_programs(0) - 1 - tl.program_id(0)  # longest blocks first
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if m_blk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # keys already cached before this chunk

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    io_mask = (offs_m[:, None] < q_len) & dmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    q_pos = ctx + offs_m  # each row's position: it sees keys 0..q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    head_off = (h // GROUP).to(tl.int64) * stride_ch
    full_end = ((ctx + m_blk * BLOCK_M + 1) // BLOCK_N) * BLOCK_N  # tiles seen in full by every row
    hi = ctx + tl.minimum((m_blk + 1) * BLOCK_M, q_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_row, head_off, n0, offs_d, dmask, q_pos, hi,
                                     stride_cb, stride_ckv, stride_cs, qk_scale, PAGE, BLOCK_N, False, IEEE)  # fmt: skip
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_row, head_off, n0, offs_d, dmask, q_pos, hi,
                                     stride_cb, stride_ckv, stride_cs, qk_scale, PAGE, BLOCK_N, True, IEEE)  # fmt: skip
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=io_mask)  # fmt: skip


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles measured on an H200 (docs/benchmarks.md, "Kernels"); fp32 (numerics tests) gets small ones."""
    if small_tiles():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64 if head_dim <= 128 else 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 128:  # K/V tiles of 128 keys, 3 stages
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


CANDIDATES = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
]


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_query_len: int,
    scale: float,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    T, hq, d = query.shape
    B = seq_lens.shape[0]
    out = torch.empty_like(query)
    if T == 0 or B == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    cfg = config or default_config(d, query.dtype)
    grid = (cdiv(max_query_len, cfg["BLOCK_M"]), hq, B)
    _prefill_kernel[grid](
        query, kv_cache, block_tables, query_start_loc, seq_lens, out,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=hq // kv_cache.shape[3], HEAD_DIM=d, D_PAD=max(16, next_pow2(d)), PAGE=kv_cache.shape[2],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], IEEE=ieee(query), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
