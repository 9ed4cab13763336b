"""MLA decode attention for Hopper (sm_90) at few heads (≤ 32, a tensor-parallel rank's share of
DeepSeek-V3's 128): tokens on the tensor core's M side.

Same contract as `mla_decode.mla_decode_attention`. A warp-group MMA has at least 64 rows. With the
heads as rows (`mla_decode_wgmma`) 16 heads leave three quarters of every instruction empty, and
the padded kernel is bound by that wasted work, well short of the memory floor, although the
op itself is memory-bound. Here the tile is transposed: the 64 tokens of a latent tile are the
rows and the heads the columns,

- scores: S^T [tokens, heads] = K [tokens, 576] · Q^T (the latent tile is A, Q is B);
- softmax runs down the columns (the row maximum becomes a column maximum over the 4 warps);
- output: O^T [512, heads] += V^T · P^T, V^T being the same latent tile read transposed.

So every instruction carries real heads and the work per tile is a quarter of the padded
kernel's. One warp group per program; latent tiles stream through two shared-memory stages by
`cp.async`. Shared memory: 2 stages x 72 KiB + Q (≤ 36 KiB) + P^T.

The op is bound by the card's read rate: this kernel's loads alone run close to the memory floor,
the kernel at 2 splits little above its loads, and the op adds the merge. Under `do_bench`'s memset
flush the loads took as long from 64 multiprocessors as from 128. Two variants were slower or not worth keeping: a producer warp
bringing the tiles by TMA (slower: with the stages full, the copies cannot start earlier whoever
issues them), and merging the splits in the kernel (the last split merges, by a ticket), which saved
little of the merge for a device-wide ticket array and a sum whose order varies from run to run
(docs/benchmarks.md, "Figures formerly in code").
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer_kernels.triton_impl.mla_sm90_common import (
    _async_load,
    _cta_barrier,
    _gather_tile,
    _tile_pages,
    sm90_latent_operands,
)

BLOCK_H = 32  # most heads per program (the MMA's N); fewer heads use a 16-wide tile
BLOCK_N = 64  # tokens per tile: the smallest wgmma M
NUM_WARPS = 4


@gluon.jit
def _attend_tile_t(qn_smem, qp_smem, kc, kr, pt_smem, m_i, l_acc, acc, n0, end, qk_scale,
                   s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """One tile of the online softmax, transposed: `s` is [tokens, heads], `acc` is O^T [LORA, heads]."""
    BLOCK_N: gl.constexpr = kc.shape[0]
    BLOCK_H: gl.constexpr = qn_smem.shape[0]
    s = warpgroup_mma(kc, qn_smem.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)  # fmt: skip
    s = warpgroup_mma(kr, qp_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = s * qk_scale  # log2 units
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    s = gl.where((rows < end)[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_acc = l_acc * alpha[None, :] + p
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
    pt_smem.store(p.to(pt_smem.dtype))
    fence_async_shared()
    _cta_barrier()  # every warp's rows of P^T are in shared memory
    acc = warpgroup_mma(kc.permute((1, 0)), pt_smem, acc, is_async=True)  # V^T: the latent read transposed
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _cta_barrier()  # P^T and this stage are free for the next writes
    return m_new, l_acc, acc


@gluon.jit
def _mla_decode_narrow_kernel(
    qn_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    stride_qnb, stride_qnh, stride_qpb, stride_qph, stride_cb, stride_cs, stride_btb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, NUM_HEADS, num_splits,
    LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WRITE_LSE: gl.constexpr,
):  # fmt: skip
    gl.static_assert(gl.num_warps() == 4, "one warp group")
    dtype: gl.constexpr = qn_ptr.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 16])  # fmt: skip
    o_layout: gl.constexpr = s_layout  # O^T [LORA, BLOCK_H]: the same instruction shape, LORA / 64 repeats
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte cp.async
    store_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])  # dims fastest: coalesced
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LORA], dtype)
    qp_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LORA], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    pt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)

    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    seq_len = gl.load(seq_lens_ptr + b)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)

    qn_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LORA], qn_sl)
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qp_sl)
    kc_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], kr_sl)
    pt_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], pt_sl)

    heads_l = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    hmask_l = (heads_l < NUM_HEADS)[:, None]  # padded heads read zeros: finite scores, outputs not stored
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    _async_load(qn_smem, qn_ptr + b * stride_qnb + heads_l[:, None] * stride_qnh + offs_c[None, :], mask=hmask_l)
    _async_load(qp_smem, qp_ptr + b * stride_qpb + heads_l[:, None] * stride_qph + offs_r[None, :], mask=hmask_l)
    bt_row = bt_ptr + b * stride_btb
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_acc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)  # column sums, reduced once at the end
    acc = gl.zeros([LORA, BLOCK_H], gl.float32, layout=o_layout)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    if n_tiles > 0:
        _gather_tile(kc_smem.index(0), kr_smem.index(0), cache_ptr,
                     _tile_pages(bt_row, start, end, PAGE, BLOCK_N, load_layout), start, end, stride_cb, stride_cs,
                     LORA, ROPE, PAGE, BLOCK_N, load_layout)  # fmt: skip
    cp.commit_group()
    pages = _tile_pages(bt_row, start + BLOCK_N, end, PAGE, BLOCK_N, load_layout)
    for i in range(n_tiles):
        stage = i % 2
        n0 = start + i * BLOCK_N
        if i + 1 < n_tiles:
            _gather_tile(kc_smem.index(1 - stage), kr_smem.index(1 - stage), cache_ptr, pages, n0 + BLOCK_N, end,
                         stride_cb, stride_cs, LORA, ROPE, PAGE, BLOCK_N, load_layout)  # fmt: skip
        cp.commit_group()
        pages = _tile_pages(bt_row, n0 + 2 * BLOCK_N, end, PAGE, BLOCK_N, load_layout)
        cp.wait_group(1)
        fence_async_shared()
        _cta_barrier()
        m_i, l_acc, acc = _attend_tile_t(qn_smem, qp_smem, kc_smem.index(stage), kr_smem.index(stage), pt_smem,
                                         m_i, l_acc, acc, n0, end, qk_scale, s_layout, o_layout)  # fmt: skip
    cp.wait_group(0)

    l_i = gl.sum(l_acc, axis=0)
    empty = l_i == 0.0
    o = acc / gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(0, o_layout))[None, :]
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), store_layout)
    dims_o = gl.arange(0, LORA, layout=gl.SliceLayout(1, store_layout))
    heads_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, store_layout))
    o_ptrs = out_ptr + b * stride_ob + heads_o[None, :] * stride_oh + split * stride_os + dims_o[:, None]
    gl.store(o_ptrs, o, mask=(heads_o < NUM_HEADS)[None, :])
    if WRITE_LSE:
        heads_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        gl.store(lse_ptr + b * stride_lb + heads_s * stride_lh + split, lse, mask=heads_s < NUM_HEADS)


def supports(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """`sm90_latent_operands` with at most `BLOCK_H` heads."""
    return q_nope.shape[1] <= BLOCK_H and sm90_latent_operands(q_nope, q_pe, latent_cache)


def launch(q_nope, q_pe, latent_cache, block_tables, seq_lens, qk_scale, o, o_strides, lse, lse_strides,
           num_splits: int) -> None:  # fmt: skip
    """Run the kernel into `o` (the output, or the split partials with `lse`)."""
    B, H, lora = q_nope.shape
    _mla_decode_narrow_kernel[(B, num_splits)](
        q_nope, q_pe, latent_cache, block_tables, seq_lens, o, lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        *o_strides, *lse_strides, qk_scale, H, num_splits,
        LORA=lora, ROPE=q_pe.shape[-1], PAGE=latent_cache.shape[1], BLOCK_H=16 if H <= 16 else 32,
        BLOCK_N=BLOCK_N, WRITE_LSE=num_splits > 1, num_warps=NUM_WARPS,
    )  # fmt: skip
