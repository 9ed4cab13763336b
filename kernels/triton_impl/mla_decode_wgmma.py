"""MLA decode attention for Hopper (sm_90): two warp groups share every latent tile without
duplicating work.

Same contract as `mla_decode.mla_decode_attention` (absorbed form, latent cache
`[num_blocks, block_size, kv_lora_rank + rope]`, split-KV partials merged by the caller).

Why a second kernel: with 64 heads per program the scores `[64, BLOCK_N]` are one warp group's
worth of rows. `tl.dot` lays a dot that feeds another dot with every warp along the rows, so
with 8 warps both warp groups compute the whole score tile (1.5x the tensor-core work at
DeepSeek-V3's 128 heads, where this op is compute-bound). Here the layouts are explicit:

- scores: warp group g computes the tile's tokens `[g * BLOCK_N/2, (g+1) * BLOCK_N/2)`;
- the row maximum is combined across the two groups (a cross-warp reduction);
- P goes through shared memory, and warp group g accumulates output dims
  `[g * LORA/2, (g+1) * LORA/2)` over all of the tile's tokens.

Each tensor-core instruction then runs once. Latent tiles stream through two shared-memory
stages with `cp.async` (the block table scatters pages, so rows are gathered per token): the
next tile loads while this one computes. Shared memory: Q 72 KiB + 2 stages x 72 KiB + P 8 KiB.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# Triton 3.6 names the cp.async gather `async_copy_global_to_shared` and the CTA barrier
# `thread_barrier`; later releases `async_load` and `barrier`.
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_H = 64  # one warp group's rows: the smallest wgmma M
BLOCK_N = 64
NUM_WARPS = 8


@gluon.jit
def _tile_pages(bt_row, n0, end, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, load_layout: gl.constexpr):
    """Page id of each token in [n0, n0 + BLOCK_N) (0 past `end`), for the cp.async gather."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    return gl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0)


@gluon.jit
def _gather_tile(kc_buf, kr_buf, cache_ptr, page, n0, end, stride_cb, stride_cs,
                 LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                 load_layout: gl.constexpr):  # fmt: skip
    """cp.async gather of tokens [n0, n0 + BLOCK_N) into one stage; rows past `end` read zeros."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    nmask = offs_n < end
    row = cache_ptr + page.to(gl.int64) * stride_cb + (offs_n % PAGE).to(gl.int64) * stride_cs
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    _async_load(kc_buf, row[:, None] + offs_c[None, :], mask=nmask[:, None])
    _async_load(kr_buf, row[:, None] + LORA + offs_r[None, :], mask=nmask[:, None])


@gluon.jit
def _attend_tile(qn_smem, qp_smem, kc, kr, p_smem, m_i, l_acc, acc, n0, end, qk_scale,
                 s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """One tile of the online softmax, its latent rows in shared memory (`kc`, `kr`)."""
    BLOCK_H: gl.constexpr = qn_smem.shape[0]
    BLOCK_N: gl.constexpr = kc.shape[0]
    s = warpgroup_mma(qn_smem, kc.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)  # fmt: skip
    s = warpgroup_mma(qp_smem, kr.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = s * qk_scale  # log2 units
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where((cols < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))  # the two warp groups' halves of each row meet here
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_acc = l_acc * alpha[:, None] + p
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _cta_barrier()  # both halves of P are in shared memory
    acc = warpgroup_mma(p_smem, kc, acc, is_async=True)  # the latent is the value
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _cta_barrier()  # P and this stage are free for the next writes
    return m_new, l_acc, acc


@gluon.jit
def _mla_decode_wgmma_kernel(
    qn_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    stride_qnb, stride_qnh, stride_qpb, stride_qph, stride_cb, stride_cs, stride_btb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, NUM_HEADS, num_splits,
    LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WRITE_LSE: gl.constexpr,
):  # fmt: skip
    gl.static_assert(gl.num_warps() == 8, "two warp groups")
    dtype: gl.constexpr = qn_ptr.dtype.element_ty
    # warps [4, 2]: the second warp group takes the right half of N (tokens for S, dims for O)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, LORA // 2, 16])  # fmt: skip
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte cp.async
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LORA], dtype)
    qp_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LORA], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

    hb = gl.program_id(0)  # head blocks of one (sequence, split) are neighbours: they share tiles in L2
    b = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)

    qn_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LORA], qn_sl)
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qp_sl)
    kc_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)

    heads_l = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    hmask_l = (heads_l < NUM_HEADS)[:, None]
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    _async_load(qn_smem, qn_ptr + b * stride_qnb + heads_l[:, None] * stride_qnh + offs_c[None, :], mask=hmask_l)
    _async_load(qp_smem, qp_ptr + b * stride_qpb + heads_l[:, None] * stride_qph + offs_r[None, :], mask=hmask_l)
    bt_row = bt_ptr + b * stride_btb
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)  # row sums, reduced once at the end
    acc = gl.zeros([BLOCK_H, LORA], gl.float32, layout=o_layout)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    if n_tiles > 0:
        _gather_tile(kc_smem.index(0), kr_smem.index(0), cache_ptr,
                     _tile_pages(bt_row, start, end, PAGE, BLOCK_N, load_layout), start, end, stride_cb, stride_cs,
                     LORA, ROPE, PAGE, BLOCK_N, load_layout)  # fmt: skip
    cp.commit_group()
    # the next tile's page ids, read a tile ahead: the block table's latency stays off the loop
    pages = _tile_pages(bt_row, start + BLOCK_N, end, PAGE, BLOCK_N, load_layout)
    for i in range(n_tiles):
        stage = i % 2
        n0 = start + i * BLOCK_N
        if i + 1 < n_tiles:  # the other stage was last read by the previous tile, which has finished
            _gather_tile(kc_smem.index(1 - stage), kr_smem.index(1 - stage), cache_ptr, pages, n0 + BLOCK_N, end,
                         stride_cb, stride_cs, LORA, ROPE, PAGE, BLOCK_N, load_layout)  # fmt: skip
        cp.commit_group()
        pages = _tile_pages(bt_row, n0 + 2 * BLOCK_N, end, PAGE, BLOCK_N, load_layout)
        cp.wait_group(1)  # this thread's copies of tile i (and Q) are in
        fence_async_shared()
        _cta_barrier()  # ... and every other thread's
        m_i, l_acc, acc = _attend_tile(qn_smem, qp_smem, kc_smem.index(stage), kr_smem.index(stage), p_smem,
                                       m_i, l_acc, acc, n0, end, qk_scale, s_layout, o_layout)  # fmt: skip
    cp.wait_group(0)

    l_i = gl.sum(l_acc, axis=1)
    empty = l_i == 0.0
    o = acc / gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))[:, None]
    heads_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    dims_o = gl.arange(0, LORA, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = out_ptr + b * stride_ob + heads_o[:, None] * stride_oh + split * stride_os + dims_o[None, :]
    gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(heads_o < NUM_HEADS)[:, None])
    if WRITE_LSE:
        heads_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        gl.store(lse_ptr + b * stride_lb + heads_s * stride_lh + split, lse, mask=heads_s < NUM_HEADS)


def supports(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, min_heads: int = BLOCK_H) -> bool:
    """Hopper, 16-bit, DeepSeek's latent dims (512 + 64), and at least `min_heads` heads (by default
    enough to fill a warp group's rows; fewer leave rows of the tile empty)."""
    if not q_nope.is_cuda or torch.cuda.get_device_capability(q_nope.device) != (9, 0):
        return False
    return (
        q_nope.dtype in (torch.bfloat16, torch.float16)
        and q_pe.dtype == latent_cache.dtype == q_nope.dtype
        and q_nope.shape[-1] == 512
        and q_pe.shape[-1] == 64
        and q_nope.shape[1] >= min_heads
        and latent_cache.stride(1) % 8 == 0  # 16-byte rows for cp.async
        and latent_cache.stride(0) % 8 == 0
    )


def launch(q_nope, q_pe, latent_cache, block_tables, seq_lens, qk_scale, o, o_strides, lse, lse_strides,
           num_splits: int) -> None:  # fmt: skip
    """Run the kernel into `o` (the output, or the split partials with `lse`)."""
    B, H, lora = q_nope.shape
    _mla_decode_wgmma_kernel[(triton.cdiv(H, BLOCK_H), B, num_splits)](
        q_nope, q_pe, latent_cache, block_tables, seq_lens, o, lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        *o_strides, *lse_strides, qk_scale, H, num_splits,
        LORA=lora, ROPE=q_pe.shape[-1], PAGE=latent_cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        WRITE_LSE=num_splits > 1, num_warps=NUM_WARPS,
    )  # fmt: skip
