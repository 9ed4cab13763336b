"""MLA decode attention in absorbed form over the compressed latent cache, split-KV.

Each cached token is one row `[c_kv (kv_lora_rank) | k_pe (rope dim)]`; it is the key of
every head, and its first `kv_lora_rank` entries are the value. A head's score is
q_nope·c_kv + q_pe·k_pe (q_nope already multiplied by W_UK), and its output stays in the
latent space (the caller applies W_UV). One program per (sequence, block of heads, split):
a block of heads shares every latent tile it loads, and the tile loaded for the scores is
reused as the value.

On sm_90, at 16 bits with DeepSeek's latent dims, `mla_decode_attention` runs a warp-group kernel
written in Gluon instead: `mla_decode_wgmma` from 64 heads (warp-specialised: two warp groups take
turns on the tensor cores while two producer warps bring rows by TMA; `tl.dot` would have both
groups compute every score) and `mla_decode_wgmma_narrow` up to 32 (tokens as the MMA's rows, so
few heads waste no tensor-core work); `config={"kernel": "tl"}` keeps this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, dot, ieee, next_pow2, sm_count, small_tiles
from deepinfer_kernels.triton_impl.split_kv import choose_num_splits, merge_splits

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(row, offs, n: tl.constexpr, n_pad: tl.constexpr, nmask, MASKED: tl.constexpr):
    """[BLOCK_N, n_pad] of the cached rows at `row + offs`; predicates only where needed."""
    if MASKED:  # zeros past the end: p is 0 there, and 0 * (stale bits, maybe NaN) must not reach acc
        return tl.load(row[:, None] + offs[None, :], mask=nmask[:, None] & (offs < n)[None, :], other=0.0)
    elif n == n_pad:
        return tl.load(row[:, None] + offs[None, :])
    else:
        return tl.load(row[:, None] + offs[None, :], mask=(offs < n)[None, :], other=0.0)


@triton.jit
def _mla_tile(
    qn, qp, m_i, l_i, acc, n0, end, bt_row, cache_ptr, stride_cb, stride_cs, qk_scale,
    LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N-token tile of the online softmax. Only the tail tile is MASKED: full tiles
    build no predicates, which keeps the [BLOCK_H, LORA] accumulator out of spill range."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    if MASKED:
        page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    row = cache_ptr + page * stride_cb + (offs_n % PAGE) * stride_cs
    kc = _load_rows(row, tl.arange(0, LORA_PAD), LORA, LORA_PAD, nmask, MASKED).to(qn.dtype)
    kr = _load_rows(row + LORA, tl.arange(0, ROPE_PAD), ROPE, ROPE_PAD, nmask, MASKED).to(qp.dtype)
    s = dot(qn, tl.trans(kc), tl.zeros([qn.shape[0], BLOCK_N], tl.float32), IEEE)
    s = dot(qp, tl.trans(kr), s, IEEE) * qk_scale  # [H, N], log2 units
    if MASKED:
        s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot(p.to(kc.dtype), kc, acc * alpha[:, None], IEEE)  # the latent is the value
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    qn_ptr,
    qp_ptr,
    cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    stride_qnb,
    stride_qnh,
    stride_qpb,
    stride_qph,
    stride_cb,
    stride_cs,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    qk_scale,
    NUM_HEADS,
    LORA: tl.constexpr,
    LORA_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    WRITE_LSE: tl.constexpr,
    IEEE: tl.constexpr,
    TAIL_ONLY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    hmask = heads < NUM_HEADS
    offs_c = tl.arange(0, LORA_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    cmask = offs_c < LORA
    rmask = offs_r < ROPE
    qn = tl.load(qn_ptr + b * stride_qnb + heads[:, None] * stride_qnh + offs_c[None, :],
                 mask=hmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
    qp = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    # TAIL_ONLY: only the last tile builds masks (fewer live predicates: less spilling with the
    # 64-head accumulator); otherwise every tile is masked (smaller code, better for small head tiles)
    if TAIL_ONLY:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _mla_tile(qn, qp, m_i, l_i, acc, n0, end, bt_row, cache_ptr, stride_cb, stride_cs,
                                      qk_scale, LORA, LORA_PAD, ROPE, ROPE_PAD, PAGE, BLOCK_N, False, IEEE)  # fmt: skip
        if full_end < end:
            m_i, l_i, acc = _mla_tile(qn, qp, m_i, l_i, acc, full_end, end, bt_row, cache_ptr, stride_cb, stride_cs,
                                      qk_scale, LORA, LORA_PAD, ROPE, ROPE_PAD, PAGE, BLOCK_N, True, IEEE)  # fmt: skip
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _mla_tile(qn, qp, m_i, l_i, acc, n0, end, bt_row, cache_ptr, stride_cb, stride_cs,
                                      qk_scale, LORA, LORA_PAD, ROPE, ROPE_PAD, PAGE, BLOCK_N, True, IEEE)  # fmt: skip

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def default_config(num_heads: int, lora: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles measured on an H200 (docs/benchmarks.md, "Kernels"); fp32 (numerics tests) gets small ones."""
    if small_tiles():
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "per_sm": 1}
    if dtype == torch.float32:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "per_sm": 1}
    if num_heads <= 16:  # memory-bound: one head tile, two programs per multiprocessor
        return {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "per_sm": 2, "TAIL_ONLY": True}
    return {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "per_sm": 1, "TAIL_ONLY": True}


def _cand(h: int, n: int, warps: int, stages: int, per_sm: int, tail_only: bool) -> dict:
    return {"BLOCK_H": h, "BLOCK_N": n, "num_warps": warps, "num_stages": stages, "per_sm": per_sm,
            "TAIL_ONLY": tail_only}  # fmt: skip


CANDIDATES = [
    _cand(64, 64, 8, 2, 1, False),
    _cand(64, 64, 8, 2, 1, True),
    _cand(64, 32, 8, 3, 1, True),
    _cand(64, 32, 8, 4, 1, True),
    _cand(64, 16, 8, 3, 1, True),
    _cand(64, 16, 8, 4, 1, True),
    _cand(16, 32, 4, 3, 2, False),
    _cand(16, 32, 4, 3, 2, True),
    _cand(16, 64, 4, 2, 2, False),
    _cand(16, 64, 4, 2, 2, True),
]


def mla_decode_attention(
    q_nope: torch.Tensor,  # [B, H, kv_lora_rank], absorbed
    q_pe: torch.Tensor,  # [B, H, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [B, H, kv_lora_rank]
    B, H, lora = q_nope.shape
    rope = q_pe.shape[-1]
    page = latent_cache.shape[1]
    assert latent_cache.shape[2] == lora + rope and latent_cache.stride(-1) == 1
    out = torch.empty_like(q_nope)
    if B == 0:
        return out
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    cfg = config or default_config(H, lora, q_nope.dtype)
    hopper = _hopper_kernel(q_nope, q_pe, latent_cache, cfg.get("kernel", "auto"))
    if hopper is not None:  # one program per multiprocessor: its stages fill the shared memory
        block_h, per_sm = hopper.BLOCK_H, 1
    else:
        block_h, per_sm = min(cfg["BLOCK_H"], max(16, next_pow2(H))), cfg["per_sm"]
    head_blocks = cdiv(H, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(
            B * head_blocks, block_tables.shape[1] * page, sm_count(q_nope.device), per_sm=per_sm
        )
    if num_splits > 1:
        part_o = torch.empty((B, H, num_splits, lora), dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q_nope.device)
        o, o_strides, lse, lse_strides = part_o, part_o.stride()[:3], part_lse, part_lse.stride()[:2]
    else:
        o, o_strides, lse, lse_strides = out, (*out.stride()[:2], 0), out, (0, 0)
    if hopper is not None:
        hopper.launch(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale * LOG2E, o, o_strides, lse,
                      lse_strides, num_splits)  # fmt: skip
    else:
        _launch_tl(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale, cfg, block_h, head_blocks, num_splits,
                   o, o_strides, lse, lse_strides)  # fmt: skip
    if num_splits > 1:
        merge_splits(part_o, part_lse, out)
    return out


def _launch_tl(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale, cfg, block_h, head_blocks, num_splits,
               o, o_strides, lse, lse_strides) -> None:  # fmt: skip
    B, H, lora = q_nope.shape
    rope, page = q_pe.shape[-1], latent_cache.shape[1]
    _mla_decode_kernel[(B, head_blocks, num_splits)](
        q_nope, q_pe, latent_cache, block_tables, seq_lens, o, lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        *o_strides, *lse_strides, scale * LOG2E, H,
        LORA=lora, LORA_PAD=max(16, next_pow2(lora)), ROPE=rope, ROPE_PAD=max(16, next_pow2(rope)), PAGE=page,
        BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], num_splits=num_splits, WRITE_LSE=num_splits > 1, IEEE=ieee(q_nope),
        TAIL_ONLY=cfg.get("TAIL_ONLY", False), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def _hopper_kernel(q_nope, q_pe, latent_cache, choice: str = "auto"):
    """The module of the sm_90 warp-group kernel that applies, else None (its Gluon front end needs
    Triton 3.6 or later; older releases lack the module or some of its names).

    `choice`: "auto" (heads as the MMA's rows from 64 heads, tokens as its rows up to 32), "tl"
    (never), "wgmma" (heads as rows at any head count, the tile's rows partly empty) or "narrow"."""
    if not q_nope.is_cuda or choice == "tl":
        return None
    try:
        from deepinfer_kernels.triton_impl import mla_decode_wgmma, mla_decode_wgmma_narrow
    except (ImportError, AttributeError):
        return None
    heads = q_nope.shape[1]
    if choice == "narrow" or (choice == "auto" and heads <= mla_decode_wgmma_narrow.BLOCK_H):
        module, ok = mla_decode_wgmma_narrow, mla_decode_wgmma_narrow.supports(q_nope, q_pe, latent_cache)
    else:
        min_heads = 1 if choice == "wgmma" else mla_decode_wgmma.BLOCK_H
        module, ok = mla_decode_wgmma, mla_decode_wgmma.supports(q_nope, q_pe, latent_cache, min_heads)
    return module if ok else None
