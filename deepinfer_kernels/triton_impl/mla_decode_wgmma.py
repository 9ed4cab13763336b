"""MLA decode attention for Hopper (sm_90), warp-specialised: two consumer warp groups that take
turns on 128-token steps and two producer warps, one per buffer, that bring the latent rows.

This file is longer than the project's 400 lines on purpose: the producer and consumer partitions,
their barriers and the one-way hand-over of the row maximum are a single schedule, each part timed
against the others, and it reads only as a whole.

Same contract as `mla_decode.mla_decode_attention` (64 heads per program, split-KV partials merged
by the caller). With 64 heads as the MMA's rows and 128 heads, this op is compute-bound. Two warp
groups in lock step on 64-token tiles (this kernel's predecessor) each computed scores for only 32
tokens (`m64n32k16`, bound by shared-memory reads of Q), and the tensor cores idled during the
softmax and the cross-group maximum. Here:

- a step is two 64-token blocks in two buffers K0, K1; consumer group g scores block g alone
  (`m64n64k16`: as many bytes read from shared memory as the tensor core consumes), both groups at
  once: FlashMLA's order (group 1's scores after group 0's, one softmax under the other's scores)
  measured slower with two buffers, also with group 1's P·V reordered to free K0 first;
- the row maximum is handed one way: group 0 publishes its block's maximum, group 1 folds its own
  in and publishes the step's maximum, group 0 rescales what it has already done; the maxima are
  lazy (`LAZY_RESCALE_LOG2`), so most steps skip the rescaling;
- each group keeps half of the output (256 of the 512 dims) and multiplies both blocks' P (its
  own and the other group's, the latter through shared memory) with its half of the values;
- two producer warps, one per buffer, bring the next step's rows by TMA (`cp.async` for a split's
  partial last block, pages under 8 tokens and caches whose pages are not back to back), each half
  of a buffer's columns as soon as its last reader is done (mbarriers, no CTA-wide barrier in the
  loop), so loads and one group's softmax run under the other group's tensor-core work.

What the loads cost. Each of the two programs of a sequence (64 heads each) reads every latent row,
so at 128 heads a step moves 144 KiB from L2 into each multiprocessor's shared memory. The loads
alone and the consumers alone each take most of the kernel's time, so the kernel is only as fast as
it overlaps them. Variants timed side by side chose the loads' shape:
- TMA boxes of a page (at most 64 rows) x 64 columns instead of per-thread `cp.async` (a half is
  4-5 boxes at 64-token pages, 16-20 at 16): faster at 64-token pages, alike at 16;
- the rope columns travel with the half a block's scores start on (only the scores read them), so
  the half freed last, at the end of a step, is the smaller one;
- one producer per buffer: with one producer, a half's refill waited behind the other buffer's,
  freed in a different order.
- not kept: the two programs of a sequence as a 2-CTA cluster, each CTA bringing half of a
  block's rows by TMA multicast into both. That halves the L2 reads, but a half is then refilled
  only once both multiprocessors' consumers have freed it, and the kernel was slower; the loads
  alone are no faster with multicast: each multiprocessor still takes in 144 KiB a step.

Where the time goes (after a read flush). At 16-token pages half a block was 16-20 boxes instead
of 4-5, and issuing them sits on the refill chain, so the kernel was slower there; the engine gives
MLA models 64-token blocks on CUDA (`engine_args.default_block_size`). Since then a 64-token block's
half comes as one 3D box (2 with the rope columns) and TMA-filled blocks skip the consumers' proxy
fences. Part of the time is a fixed cost: the kernel at zero length (launch, events, a fill), and
Q's read before the first step and the output's write after the last, through both of which the
tensor cores wait. The copies after the first step cost the rest beyond the consumers' work: their
shared-memory traffic beside the consumers', and the consumers waiting for refills, which are not
DRAM-bound (an L2 prefetch of the next block made it slower).

The output. Every program stores its 64 x 512 outputs at the same moment, at the end. From the
accumulator's layout (two adjacent values of a row per thread) that took a visible share of the
kernel (per-program %globaltimer marks). Each group now writes its half into a freed K buffer and
sends it by TMA (4 boxes of 64 x 64), which is faster.

Shared memory: Q 72 KiB + K0, K1 2 x 72 KiB + P0 8 KiB; P1 reuses Q's rope columns once both
consumers hold them in registers. Registers: the loops index every buffer with an opaque 0
(`j >> 30`); with constant indices the compiler hoists the ~80 loop-invariant shared-memory
descriptors out of the loops and spills them (60+ local loads per step, and a much slower kernel).
All the figures: docs/benchmarks.md, "Figures formerly in code".
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepinfer_kernels.triton_impl.common import cdiv
from deepinfer_kernels.triton_impl.mla_sm90_common import (
    PUBLIC_REINTERPRET,
    _async_load,
    _tma_load,
    _tma_store,
    sm90_latent_operands,
)

BLOCK_H = 64
BLOCK_N = 64  # tokens per block; a step is two blocks
NUM_WARPS = 4  # the first consumer group; the second consumer and the producers are worker partitions
GROUP_THREADS = gl.constexpr(128)
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
PRODUCER_WARPS = gl.constexpr(1)  # per buffer; a TMA box is issued by one thread

# mbarrier slots
# A buffer's columns come in two halves with their own barriers: the left half (latent dims
# [0, 256)) and the right half (dims [256, 512)). Group 0 alone reads K0's left half after its
# scores and group 1 alone K0's right half (and the other way round for K1), so each half is
# refilled as soon as its last reader is done, while the rest of the step still runs. Buffer b's
# "early" half is half b: its reader frees it mid-step (K0 left by group 0's own P·V, K1 right by
# group 1's), so the block's scores start there, and its rope columns travel with it.
K_FULL = gl.constexpr(0)  # + 2 * buffer + half: the producer's rows have landed (one arrival per producer thread)
K_EMPTY = gl.constexpr(4)  # + 2 * buffer + half: its last reader is done
M0_READY = gl.constexpr(8)  # group 0 published its block's row maximum
M1_READY = gl.constexpr(9)  # group 1 published the step's row maximum
P0_READY = gl.constexpr(10)
P1_READY = gl.constexpr(11)
P0_FREE = gl.constexpr(12)  # group 1 has read P0 (group 0 may overwrite it)
P1_FREE = gl.constexpr(13)
Q_READY = gl.constexpr(14)  # Q is in shared memory
QR_TAKEN = gl.constexpr(15)  # group 0 holds Q's rope columns in registers: P1 may overwrite them
L_READY = gl.constexpr(16)  # both groups' row sums are published (count 2)
NUM_BARRIERS = gl.constexpr(17)
LEFT = gl.constexpr(0)
RIGHT = gl.constexpr(1)
# A K buffer [2, 64, 512] seen as 16 tiles of 64 rows x 64 columns (its layout stores each 64-column
# chunk as such a tile), the destination of 3D TMA boxes of four chunks.
CHUNKS_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))


# Lazy rescaling. A row's reference maximum moves only when a block's scores exceed it by more than
# 2^8 (in the log2 domain of the scores), so P stays below 256 and, once a sequence's first blocks
# have set it, rescaling is rare. A warp skips multiplying its rows of the accumulator when none of
# them moved. Side by side it is faster at both page sizes, and a little slower only where the scores
# keep growing along the sequence (their maxima keep moving; docs/benchmarks.md, "Figures formerly in
# code"). Accuracy: the largest P of a row is no longer exactly 1 in bf16, about one more bf16 unit of
# the output at most.
LAZY_RESCALE_LOG2 = gl.constexpr(8.0)
ACC_PER_THREAD = gl.constexpr(128)  # a group's [64, 256] fp32 accumulator over its 128 threads


def _rescale_asm(n: int) -> tuple[str, str]:
    """PTX for one thread's whole accumulator: one branch around its n multiplications. A branch per
    16, 32 or 64 of them measured slower (docs/benchmarks.md, "Figures formerly in code"): each branch
    keeps the compiler from interleaving other work across it."""
    muls = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    asm = f"{{ .reg .pred skip; setp.eq.f32 skip, ${3 * n}, 0f00000000; @skip bra.uni DONE; {muls} DONE: }}"
    # outputs, the accumulator tied to them (updated in place), the factors, the warp's moved flags
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * (2 * n))
    return asm, constraints


RESCALE_ASM, RESCALE_CONSTRAINTS = (gl.constexpr(x) for x in _rescale_asm(ACC_PER_THREAD.value))


@gluon.jit
def _warp_moved(m_new, m_old):
    """1.0 in every row of a warp of which any row's reference maximum moved, else 0.0: a warp vote over
    its rows (each thread holds two), no shared memory and no barrier."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.f32 p, $2, $4; setp.ne.or.f32 p, $3, $5, p; vote.sync.any.pred p, p, -1; "
        "selp.f32 $0, 0f3F800000, 0f00000000, p; mov.b32 $1, $0; }",
        "=f,=f,f,f,f,f", [m_new, m_old], dtype=gl.float32, is_pure=True, pack=2)  # fmt: skip


@gluon.jit
def _rescale(acc, factor, moved, o_layout: gl.constexpr):
    """acc * factor (per row), skipped by the warps whose rows did not move (`_warp_moved`)."""
    gl.static_assert(acc.shape[0] * acc.shape[1] == ACC_PER_THREAD * GROUP_THREADS)
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    f = gl.convert_layout(factor, rows)[:, None]
    mv = gl.convert_layout(moved, rows)[:, None]
    return gl.inline_asm_elementwise(RESCALE_ASM, RESCALE_CONSTRAINTS, [acc, f, mv], dtype=gl.float32,
                                     is_pure=True, pack=ACC_PER_THREAD)  # fmt: skip


@gluon.jit
def _scores(qn_smem, qr, kbuf, krbuf, bars, buf: gl.constexpr, first: gl.constexpr, ph, gathered,
            s_layout: gl.constexpr):  # fmt: skip
    """S = Q_nope · K_c^T + Q_rope · K_r^T for one 64-token block (Q's rope columns from registers):
    the `first` column half and the rope columns as soon as they have landed, then the other half.
    `gathered`: the producer wrote the block by `cp.async` (the generic proxy), so the tensor core's
    reads need a proxy fence; TMA writes through the async proxy and needs none."""
    BLOCK_H: gl.constexpr = qn_smem.shape[0]
    BLOCK_N: gl.constexpr = kbuf.shape[0]
    HALF: gl.constexpr = qn_smem.shape[1] // 2
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(bars.index(K_FULL + 2 * buf + first), ph)
    if gathered:
        fence_async_shared()
    s = warpgroup_mma(qn_smem.slice(first * HALF, HALF, dim=1), kbuf.slice(first * HALF, HALF, dim=1).permute((1, 0)),
                      s, use_acc=False, is_async=True)  # fmt: skip
    s = warpgroup_mma(qr, krbuf.permute((1, 0)), s, is_async=True)  # the rope rows came with the first half
    mbarrier.wait(bars.index(K_FULL + 2 * buf + (1 - first)), ph)
    if gathered:
        fence_async_shared()
    s = warpgroup_mma(qn_smem.slice((1 - first) * HALF, HALF, dim=1),
                      kbuf.slice((1 - first) * HALF, HALF, dim=1).permute((1, 0)), s, is_async=True)  # fmt: skip
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _mask_scale(s, n0, end, qk_scale, s_layout: gl.constexpr):
    BLOCK_N: gl.constexpr = s.shape[1]
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where((cols < end)[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """P (fp32, score layout) as the register-side operand of the P·V instruction."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _consumer0(qn_smem, qp_smem, kc_smem, kr_smem, p0_smem, m_smem, l_smem, bars, qn_base, qp_base,
               stride_qnh, stride_qph, NUM_HEADS, hb, start, end, n_steps, qk_scale, out_base, stride_oh, lse_base,
               stride_lh, out_desc, out_row, WRITE_LSE: gl.constexpr, USE_TMA: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """Group 0: loads Q, scores the first block of every step, owns output dims [0, 256)."""
    BLOCK_H: gl.constexpr = qn_smem.shape[1]
    LORA: gl.constexpr = qn_smem.shape[2]
    ROPE: gl.constexpr = qp_smem.shape[1]
    BLOCK_N: gl.constexpr = kc_smem.shape[1]
    HALF: gl.constexpr = LORA // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads_l = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    hmask = (heads_l < NUM_HEADS)[:, None]
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    _async_load(qn_smem.index(0), qn_base + heads_l[:, None] * stride_qnh + offs_c[None, :], mask=hmask)
    _async_load(qp_smem, qp_base + heads_l[:, None] * stride_qph + offs_r[None, :], mask=hmask)
    cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
    mbarrier.wait(bars.index(Q_READY), 0)
    fence_async_shared()
    qr = qp_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    mbarrier.arrive(bars.index(QR_TAKEN), count=1)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    for j in range(n_steps):
        ph = j & 1
        z = j >> 30  # 0, but not provably: the buffers' descriptors are rebuilt in the loop, not hoisted and spilled
        n0 = start + j * (2 * BLOCK_N)
        # K0's left half is refilled first (group 0 frees it early): start there
        gathered = (not USE_TMA) or n0 + BLOCK_N > end  # as _load_half decides
        s = _scores(qn_smem.index(z), qr, kc_smem.index(z), kr_smem.index(z), bars, 0, LEFT, ph, gathered, s_layout)
        s = _mask_scale(s, n0, end, qk_scale, s_layout)
        mx = gl.max(s, axis=1)
        m0 = gl.where(mx > m_i + LAZY_RESCALE_LOG2, mx, m_i)
        m_smem[0].store(m0)
        mbarrier.arrive(bars.index(M0_READY), count=1)
        alpha = gl.exp2(m_i - m0)
        p = gl.exp2(s - m0[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = _rescale(acc, alpha, _warp_moved(m0, m_i), o_layout)
        acc = warpgroup_mma(
            _p_operand(p, p0_smem.dtype, o_layout), kc_smem.index(z).slice(0, HALF, dim=1), acc, is_async=True
        )
        mbarrier.wait(bars.index(M1_READY), ph)  # group 1 folded its block in: the step's maximum
        m1 = m_smem[1].load(row_layout)
        scale1 = gl.exp2(m0 - m1)
        moved1 = _warp_moved(m1, m0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(bars.index(K_EMPTY + 0 + LEFT), count=1)  # K0's left half: group 0 was its last reader
        acc = _rescale(acc, scale1, moved1, o_layout)
        l_i = l_i * scale1
        m_i = m1
        mbarrier.wait(bars.index(P0_FREE), ph ^ 1)  # group 1 has read the previous step's P0
        p0_smem.store((p * scale1[:, None]).to(p0_smem.dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(P0_READY), count=1)
        mbarrier.wait(bars.index(P1_READY), ph)
        fence_async_shared()
        # P1 (in Q's rope buffer) · V1
        acc = warpgroup_mma(qp_smem, kc_smem.index(1 + z).slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(bars.index(P1_FREE), count=1)
        mbarrier.arrive(bars.index(K_EMPTY + 2 + LEFT), count=1)

    _finish(acc, l_i, m_i, 0, l_smem, kc_smem, bars, hb, NUM_HEADS, out_base, stride_oh, lse_base, stride_lh,
            out_desc, out_row, o_layout, row_layout, WRITE_LSE)  # fmt: skip


@gluon.jit
def _consumer1(qn_smem, qp_smem, kc_smem, kr_smem, p0_smem, m_smem, l_smem, bars, NUM_HEADS, hb, start, end, n_steps,
               qk_scale, out_base, stride_oh, out_desc, out_row, USE_TMA: gl.constexpr, s_layout: gl.constexpr,
               o_layout: gl.constexpr):  # fmt: skip
    """Group 1: scores the second block of every step, owns output dims [256, 512)."""
    BLOCK_H: gl.constexpr = qn_smem.shape[1]
    LORA: gl.constexpr = qn_smem.shape[2]
    BLOCK_N: gl.constexpr = kc_smem.shape[1]
    HALF: gl.constexpr = LORA // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    mbarrier.wait(bars.index(Q_READY), 0)
    qr = qp_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    mbarrier.wait(bars.index(QR_TAKEN), 0)  # group 0 holds them too: Q's rope columns become P1's buffer

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    for j in range(n_steps):
        ph = j & 1
        z = j >> 30  # see _consumer0
        n1 = start + j * (2 * BLOCK_N) + BLOCK_N
        # K1's right half is refilled first (group 1 frees it mid-step): start there
        gathered = (not USE_TMA) or n1 + BLOCK_N > end
        s = _scores(qn_smem.index(z), qr, kc_smem.index(1 + z), kr_smem.index(1 + z), bars, 1, RIGHT, ph, gathered,
                    s_layout)  # fmt: skip
        s = _mask_scale(s, n1, end, qk_scale, s_layout)
        mbarrier.wait(bars.index(M0_READY), ph)
        m0 = m_smem[0].load(row_layout)
        mx = gl.max(s, axis=1)
        m1 = gl.where(mx > m0 + LAZY_RESCALE_LOG2, mx, m0)
        m_smem[1].store(m1)
        mbarrier.arrive(bars.index(M1_READY), count=1)
        moved = _warp_moved(m1, m_i)
        alpha = gl.exp2(m_i - m1)
        p = gl.exp2(s - m1[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m1
        acc = _rescale(acc, alpha, moved, o_layout)
        mbarrier.wait(bars.index(P1_FREE), ph ^ 1)  # group 0 has read the previous step's P1
        qp_smem.store(p.to(qp_smem.dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(P1_READY), count=1)
        # P1 from shared memory (it is there for group 0 anyway): registers stay free for the accumulator
        acc = warpgroup_mma(qp_smem, kc_smem.index(1 + z).slice(HALF, HALF, dim=1), acc, is_async=True)
        mbarrier.wait(bars.index(P0_READY), ph)
        fence_async_shared()
        acc = warpgroup_mma(p0_smem, kc_smem.index(z).slice(HALF, HALF, dim=1), acc, is_async=True)  # P0 · V0
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(bars.index(K_EMPTY + 2 + RIGHT), count=1)  # K1's right half: group 1 was its last reader
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(bars.index(P0_FREE), count=1)
        mbarrier.arrive(bars.index(K_EMPTY + 0 + RIGHT), count=1)

    _finish(acc, l_i, m_i, 1, l_smem, kc_smem, bars, hb, NUM_HEADS, out_base, stride_oh, out_base, 0, out_desc,
            out_row, o_layout, row_layout, False)  # fmt: skip


@gluon.jit
def _finish(acc, l_i, m_i, g: gl.constexpr, l_smem, kc_smem, bars, hb, NUM_HEADS, out_base, stride_oh, lse_base,
            stride_lh, out_desc, out_row, o_layout: gl.constexpr, row_layout: gl.constexpr,
            WRITE_LSE: gl.constexpr):  # fmt: skip
    """The two groups' row sums meet; group g stores its half of the output (and the log-sum-exp):
    through a freed K buffer by TMA when there is a descriptor for the output (a whole block of heads,
    no split partials; why: "The output" in the module's docstring), else from registers."""
    BLOCK_H: gl.constexpr = acc.shape[0]
    HALF: gl.constexpr = acc.shape[1]
    l_smem[g].store(l_i)
    mbarrier.arrive(bars.index(L_READY), count=1)
    mbarrier.wait(bars.index(L_READY), 0)  # both groups are past their last P·V: the K buffers are free
    l_tot = l_i + l_smem[1 - g].load(row_layout)
    empty = l_tot == 0.0
    o = acc * gl.convert_layout(1.0 / gl.where(empty, 1.0, l_tot), gl.SliceLayout(1, o_layout))[:, None]
    if out_desc is not None:
        stage = kc_smem.index(0).slice(g * HALF, HALF, dim=1)
        stage.store(o.to(stage.dtype))
        fence_async_shared()
        for c in gl.static_range(HALF // 64):
            _tma_store(out_desc, [out_row, g * HALF + c * 64], stage.slice(c * 64, 64, dim=1))
        tma.store_wait(0)
    else:
        heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        dims = g * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        gl.store(out_base + heads[:, None] * stride_oh + dims[None, :], o.to(out_base.dtype.element_ty),
                 mask=(heads < NUM_HEADS)[:, None])  # fmt: skip
    if WRITE_LSE:
        heads_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_layout)
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_tot)))
        gl.store(lse_base + heads_s * stride_lh, lse, mask=heads_s < NUM_HEADS)


@gluon.jit
def _producer(kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, start, end, n_steps, stride_cb,
              stride_cs, PAGE: gl.constexpr, USE_TMA: gl.constexpr, buf: gl.constexpr):  # fmt: skip
    """Buffer `buf`'s block of every step (rows past `end` read zeros): its early half first."""
    BLOCK_N: gl.constexpr = kc_smem.shape[1]
    for j in range(n_steps):
        r0 = start + j * (2 * BLOCK_N) + buf * BLOCK_N
        _load_half(kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, r0, end, j, stride_cb,
                   stride_cs, buf, buf, PAGE, USE_TMA)  # fmt: skip
        _load_half(kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, r0, end, j, stride_cb,
                   stride_cs, buf, 1 - buf, PAGE, USE_TMA)  # fmt: skip


@gluon.jit
def _load_half(kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, r0, end, j, stride_cb, stride_cs,
               buf: gl.constexpr, half: gl.constexpr, PAGE: gl.constexpr, USE_TMA: gl.constexpr):  # fmt: skip
    """Step j's rows [r0, r0 + BLOCK_N) into buffer `buf`, one column half (with the rope columns if it
    is the buffer's early half), once its last reader has freed it."""
    # Where the block lies in one page, its cache row is read before waiting for the half to be freed:
    # a late half's refill is on the next step's critical path, and a block-table read after the wait
    # sat on it (docs/benchmarks.md, "Figures formerly in code").
    row0 = 0
    if USE_TMA and PAGE >= kc_smem.shape[1]:
        row0 = gl.load(bt_row + r0 // PAGE, mask=r0 < end, other=0) * PAGE + r0 % PAGE
    mbarrier.wait(bars.index(K_EMPTY + 2 * buf + half), (j & 1) ^ 1)
    if USE_TMA:
        if r0 + kc_smem.shape[1] <= end:
            _tma_half(kc_smem, kr_smem, bars, cache_desc, chunk_desc, bt_row, r0, row0, buf, half, PAGE)
        else:  # a split's partial last block: zeros past the end
            _gather_half(kc_smem, kr_smem, bars, cache_ptr, bt_row, r0, end, stride_cb, stride_cs, buf, half, PAGE)
    else:
        _gather_half(kc_smem, kr_smem, bars, cache_ptr, bt_row, r0, end, stride_cb, stride_cs, buf, half, PAGE)


@gluon.jit
def _tma_half(kc_smem, kr_smem, bars, cache_desc, chunk_desc, bt_row, r0, row0, buf: gl.constexpr,
              half: gl.constexpr, PAGE: gl.constexpr):  # fmt: skip
    """A whole block's half by TMA. Where the block lies in one page (pages of 64 tokens or more), the
    half's four 64-column chunks come as one 3D box of `chunk_desc` (4 chunks x 64 rows x 64 columns),
    which lands as the four 2D boxes would: the buffer keeps each 64-column chunk as a [64, 64] tile of
    its own in the 128-byte swizzle. So a half is 2 boxes with the rope columns instead of 5. Shorter
    pages come in boxes of ROWS rows (a page) x 64 columns (128 bytes, the swizzle's width)."""
    BLOCK_N: gl.constexpr = kc_smem.shape[1]
    LORA: gl.constexpr = kc_smem.shape[2]
    ROPE: gl.constexpr = kr_smem.shape[2]
    HALF: gl.constexpr = LORA // 2
    ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    NBYTES: gl.constexpr = BLOCK_N * (HALF + (half == buf) * ROPE) * (kc_smem.dtype.primitive_bitwidth // 8)
    full = bars.index(K_FULL + 2 * buf + half)
    mbarrier.expect(full, NBYTES)
    mbarrier.arrive(full, count=PRODUCER_WARPS * 32 - 1)  # the barrier counts every producer thread
    for p in gl.static_range(BLOCK_N // ROWS):
        if ROWS == BLOCK_N:  # the block lies in one page: its row was read before the wait
            row = row0
            if PUBLIC_REINTERPRET:
                chunks = kc_smem.reinterpret(kc_smem.dtype, [2 * (LORA // 64), BLOCK_N, 64], CHUNKS_LAYOUT)
            else:
                chunks = kc_smem._reinterpret(kc_smem.dtype, [2 * (LORA // 64), BLOCK_N, 64], CHUNKS_LAYOUT)
            _tma_load(chunk_desc, [half * (HALF // 64), row, 0], full,
                      chunks.slice(buf * (LORA // 64) + half * (HALF // 64), HALF // 64, dim=0))  # fmt: skip
        else:
            n = r0 + p * ROWS
            row = gl.load(bt_row + n // PAGE) * PAGE + n % PAGE
            for c in gl.static_range(HALF // 64):
                chunk = kc_smem.index(buf).slice(half * HALF + c * 64, 64, dim=1)
                _tma_load(cache_desc, [row, half * HALF + c * 64], full, chunk.slice(p * ROWS, ROWS, dim=0))
        if half == buf:
            _tma_load(cache_desc, [row, LORA], full, kr_smem.index(buf).slice(p * ROWS, ROWS, dim=0))


@gluon.jit
def _gather_half(kc_smem, kr_smem, bars, cache_ptr, bt_row, r0, end, stride_cb, stride_cs, buf: gl.constexpr,
                 half: gl.constexpr, PAGE: gl.constexpr):  # fmt: skip
    """The same half by each producer thread's `cp.async` (rows past `end` read zeros)."""
    BLOCK_N: gl.constexpr = kc_smem.shape[1]
    LORA: gl.constexpr = kc_smem.shape[2]
    HALF: gl.constexpr = LORA // 2
    # 16 rows x 64 columns per issue: few live addresses (the producer warp runs on 40 registers)
    ROWS: gl.constexpr = 16
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [PRODUCER_WARPS, 1], [1, 0])
    offs_k = gl.arange(0, 64, layout=gl.SliceLayout(0, load_layout))
    for rr in gl.static_range(BLOCK_N // ROWS):
        offs_n = r0 + rr * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout))
        nmask = (offs_n < end)[:, None]
        page = gl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0)
        row = cache_ptr + page.to(gl.int64) * stride_cb + (offs_n % PAGE).to(gl.int64) * stride_cs
        for c in gl.static_range(HALF // 64):
            _async_load(kc_smem.index(buf).slice(half * HALF + c * 64, 64, dim=1).slice(rr * ROWS, ROWS, dim=0),
                        row[:, None] + (half * HALF + c * 64) + offs_k[None, :], mask=nmask)  # fmt: skip
        if half == buf:
            _async_load(kr_smem.index(buf).slice(rr * ROWS, ROWS, dim=0), row[:, None] + LORA + offs_k[None, :],
                        mask=nmask)  # fmt: skip
    cp.mbarrier_arrive(bars.index(K_FULL + 2 * buf + half), increment_count=False)


@gluon.jit
def _mla_decode_wgmma_kernel(
    qn_ptr, qp_ptr, cache_ptr, cache_desc, chunk_desc, out_desc, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    stride_qnb, stride_qnh, stride_qpb, stride_qph, stride_cb, stride_cs, stride_btb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, NUM_HEADS, num_splits,
    LORA: gl.constexpr, ROPE: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WRITE_LSE: gl.constexpr, USE_TMA: gl.constexpr,
):  # fmt: skip
    gl.static_assert(ROPE == 64, "P1 reuses Q's rope columns: a [BLOCK_H, 64] buffer")
    gl.static_assert(BLOCK_N == 64)
    dtype: gl.constexpr = qn_ptr.dtype.element_ty
    # each consumer group's scores [BLOCK_H, BLOCK_N] and its half of the output [BLOCK_H, LORA / 2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LORA // 2, 16])  # fmt: skip
    hb = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), 2 * BLOCK_N) * (2 * BLOCK_N)
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    n_steps = gl.cdiv(gl.maximum(end - start, 0), 2 * BLOCK_N)

    # [1, ...]: indexed by an opaque 0 in the loops, like the K buffers
    qn_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, LORA],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, LORA], dtype))  # fmt: skip
    qp_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype))  # fmt: skip
    kc_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, LORA], dtype))  # fmt: skip
    kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype))  # fmt: skip
    p0_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))  # fmt: skip
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout),
              gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout))  # fmt: skip
    l_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout),
              gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout))  # fmt: skip
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BARRIERS):
        if i < K_EMPTY:
            mbarrier.init(bars.index(i), count=PRODUCER_WARPS * 32)  # each producer thread (its cp.async)
        elif i == Q_READY:
            mbarrier.init(bars.index(i), count=GROUP_THREADS)
        elif i == L_READY:
            mbarrier.init(bars.index(i), count=2)
        else:
            mbarrier.init(bars.index(i), count=1)

    qn_base = qn_ptr + b * stride_qnb
    qp_base = qp_ptr + b * stride_qpb
    out_base = out_ptr + b * stride_ob + split * stride_os
    lse_base = lse_ptr + b * stride_lb + split
    bt_row = bt_ptr + b * stride_btb
    out_row = (b * NUM_HEADS + hb * BLOCK_H).to(gl.int32)  # the block's first row of the [B * H, LORA] output
    gl.warp_specialize(
        [
            (_consumer0, (qn_smem, qp_smem, kc_smem, kr_smem, p0_smem, m_smem, l_smem, bars, qn_base, qp_base,
                          stride_qnh, stride_qph, NUM_HEADS, hb, start, end, n_steps, qk_scale, out_base, stride_oh,
                          lse_base, stride_lh, out_desc, out_row, WRITE_LSE, USE_TMA, s_layout, o_layout)),
            (_consumer1, (qn_smem, qp_smem, kc_smem, kr_smem, p0_smem, m_smem, l_smem, bars, NUM_HEADS, hb, start,
                          end, n_steps, qk_scale, out_base, stride_oh, out_desc, out_row, USE_TMA, s_layout,
                          o_layout)),
            (_producer, (kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, start, end, n_steps,
                         stride_cb, stride_cs, PAGE, USE_TMA, 0)),
            (_producer, (kc_smem, kr_smem, bars, cache_ptr, cache_desc, chunk_desc, bt_row, start, end, n_steps,
                         stride_cb, stride_cs, PAGE, USE_TMA, 1)),
        ],
        [4, PRODUCER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def supports(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, min_heads: int = BLOCK_H) -> bool:
    """`sm90_latent_operands` with at least `min_heads` heads (by default enough to fill the MMA's
    64 rows; fewer leave rows of the tile empty)."""
    return q_nope.shape[1] >= min_heads and sm90_latent_operands(q_nope, q_pe, latent_cache)


@functools.cache
def _box_layout(rows: int, fp16: bool):
    """The shared-memory layout of a [rows, 64] box, built once: building it is slow Python, which eager
    decode would otherwise pay per layer and step."""
    return gl.NVMMASharedLayout.get_default_for([rows, 64], gl.float16 if fp16 else gl.bfloat16)


def _rows_descriptors(latent_cache: torch.Tensor):
    """TMA descriptors over the cache: as one [pages x page, 576] matrix in boxes of min(page, 64) rows x
    64 columns, and, for pages of 64 rows or more, as [9 column chunks, pages x page rows, 64] in boxes
    of 4 chunks x 64 rows x 64 (else None). (None, None) where TMA cannot read the cache: pages not back
    to back, pages under 8 rows, a base not 16-byte aligned, or pages that 64-token blocks do not tile
    (48 or 96 rows: a block would straddle pages, and a box must stay inside one)."""
    pages, page, width = latent_cache.shape
    tiled = BLOCK_N % page == 0 or page % BLOCK_N == 0
    if page < 8 or not tiled or latent_cache.stride(0) != page * latent_cache.stride(1) or latent_cache.data_ptr() % 16:
        return None, None
    row_stride = latent_cache.stride(1)
    rows = latent_cache.as_strided((pages * page, width), (row_stride, 1))
    box = min(page, BLOCK_N)
    desc = TensorDescriptor.from_tensor(rows, [box, 64], _box_layout(box, latent_cache.dtype == torch.float16))
    if page < BLOCK_N:
        return desc, None
    # the chunk index is an outer dimension with a smaller stride than the rows': TMA takes any strides
    # that are multiples of 16 bytes
    chunks = TensorDescriptor(latent_cache, [width // 64, pages * page, 64], [64, row_stride, 1],
                              [4, BLOCK_N, 64], CHUNKS_LAYOUT.value)  # fmt: skip
    return desc, chunks


def _output_descriptor(o: torch.Tensor, num_splits: int):
    """A TMA descriptor over the output as a [B * H, 512] matrix in boxes of 64 heads x 64 dims, or None
    (split partials, a partial block of heads, an output that is not one contiguous 16-byte aligned
    matrix): the kernel then stores from registers."""
    if num_splits > 1:  # `o` holds the split partials, [B, H, splits, LORA] fp32
        return None
    B, H, lora = o.shape
    if H % BLOCK_H or not o.is_contiguous() or o.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(
        o.view(B * H, lora), [BLOCK_H, 64], _box_layout(BLOCK_H, o.dtype == torch.float16)
    )


def launch(q_nope, q_pe, latent_cache, block_tables, seq_lens, qk_scale, o, o_strides, lse, lse_strides,
           num_splits: int) -> None:  # fmt: skip
    """Run the kernel into `o` (the output, or the split partials with `lse`)."""
    B, H, lora = q_nope.shape
    desc, chunk_desc = _rows_descriptors(latent_cache)
    _mla_decode_wgmma_kernel[(cdiv(H, BLOCK_H), B, num_splits)](
        q_nope, q_pe, latent_cache, desc, chunk_desc, _output_descriptor(o, num_splits), block_tables, seq_lens, o, lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        *o_strides, *lse_strides, qk_scale, H, num_splits,
        LORA=lora, ROPE=q_pe.shape[-1], PAGE=latent_cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        WRITE_LSE=num_splits > 1, USE_TMA=desc is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
