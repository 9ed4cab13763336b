"""Fused MoE experts: two grouped GEMMs over the expert-sorted (token, choice) rows.

`moe_align` lays the T*k rows out by expert in blocks of BLOCK_M (padding rows point past the
end); every block belongs to one expert. GEMM 1 computes gate and up for a tile of the
intermediate dimension in the same program and writes silu(gate) * up (the [T*k, 2I]
gate/up product never reaches memory). GEMM 2 multiplies by the down projection, scales each
row by its routing weight and writes it at its (token, choice) row; one more pass sums the k rows
of each token. Prefill tiles read the expert weights through TMA descriptors on sm_90+ (the
weights are regular tiles; the token rows are a gather and stay pointer loads).

Roundings follow HF transformers' experts and the torch path (`SparseMoeBlock`) op for op, as
the RMSNorm and rotary kernels do: gate and up are rounded to the activation dtype, silu(gate)
is rounded, then the product; the down projection's output is rounded before it is scaled by
the fp32 routing weight, and the scaled row is rounded once more (HF's eager experts; its
grouped_mm experts sum the fp32 rows, one rounding apart) before the k rows are summed in fp32.
Keeping silu(gate) * up and the weighting in fp32 is a little more accurate (bf16 output 0.30%
from exact fp32 instead of 0.46%), but then about two thirds of the bf16 outputs differ from the
CPU path's and HF's, and an MoE router's near-ties downstream go their own way: a DeepSeek-V3
test model's bf16 prompt logprobs came out 0.35 nats from HF's on an H200 (0.61 in the CPU
interpreter given GPU bf16 arithmetic; 0.02 with these roundings, as the torch path).
In fp32 every rounding is a no-op.

FP8 expert weights (DeepSeek-V3's block-scaled e4m3, one fp32 factor per [bn, bk] block) are
read as stored, half the bytes of bf16 (decode is bound by those bytes): each weight tile is
dequantized in registers (value x its block's factor, rounded once to the activation dtype, as
dequantizing the checkpoint would) and the dots accumulate as for bf16 weights. Scaling each K
tile's partial dot instead kept the weights exact but broke the accumulator chain of the tensor-core
pipeline: prefill ran several times slower than with bf16 weights (docs/benchmarks.md, "Figures
formerly in code").

Blocks past the padded row count exit at once, so the grid depends only on (T, k, E): no host
sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, dot, ieee, next_pow2, small_tiles
from deepinfer_kernels.triton_impl.moe_routing import moe_align


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks share each weight tile while it is in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    act_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    num_rows,
    num_m,
    K,
    N,
    TOP_K: tl.constexpr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_an,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    expert32 = tl.load(expert_ptr + pid_m)
    expert = expert32.to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < num_rows
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    wu_ptrs = wg_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
        else:
            kmask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if USE_TMA:  # weight tiles by TMA: rows past N are never stored, the K tail is zero-filled
            wg = tl.trans(w_desc.load([expert32 * 2 * N + pid_n * BLOCK_N, k0]))
            wu = tl.trans(w_desc.load([expert32 * 2 * N + N + pid_n * BLOCK_N, k0]))
        elif EVEN_K:
            wg = tl.load(wg_ptrs, mask=nmask[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=nmask[None, :], other=0.0)
        else:
            wg = tl.load(wg_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SCALE_N:  # FP8 weights: each tile dequantized (value x its block's factor) to the activation dtype
            s_row = s_ptr + expert * stride_se + (k0 // SCALE_K)
            sg = tl.load(s_row + (offs_n // SCALE_N) * stride_sn, mask=nmask, other=0.0)
            su = tl.load(s_row + (tl.cdiv(N, SCALE_N) + offs_n // SCALE_N) * stride_sn, mask=nmask, other=0.0)
            wg = (wg.to(tl.float32) * sg[None, :]).to(x.dtype)
            wu = (wu.to(tl.float32) * su[None, :]).to(x.dtype)
        acc_g = dot(x, wg, acc_g, IEEE)
        acc_u = dot(x, wu, acc_u, IEEE)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    dt = act_ptr.dtype.element_ty  # HF's roundings: gate, up, silu(gate) (x / (1 + e^-x), as torch), product
    gate = acc_g.to(dt).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)  # silu(gate) * up
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_an + offs_n[None, :]
    tl.store(a_ptrs, h.to(act_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    num_rows,
    num_m,
    K,
    N,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    expert32 = tl.load(expert_ptr + pid_m)
    expert = expert32.to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < num_rows
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        else:
            kmask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if USE_TMA:
            w = tl.trans(w_desc.load([expert32 * N + pid_n * BLOCK_N, k0]))
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SCALE_N:
            sw = tl.load(s_ptr + expert * stride_se + (k0 // SCALE_K) + (offs_n // SCALE_N) * stride_sn, mask=nmask,
                         other=0.0)  # fmt: skip
            w = (w.to(tl.float32) * sw[None, :]).to(a.dtype)
        acc = dot(a, w, acc, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # the expert's output rounded to the activation dtype (HF's down_proj), then times the fp32 weight
    weight = tl.load(topk_w_ptr + rows64, mask=rmask, other=0.0)
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    o_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _sum_choices_kernel(rows_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum of the token's TOP_K weighted expert rows, in fp32, rounded once (as torch's sum)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_choices(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T * k, H] -> [T, H]: one pass at copy speed (torch's strided sum over k fell well short of it)."""
    TK, H = rows.shape
    out = torch.empty((TK // top_k, H), dtype=rows.dtype, device=rows.device)
    block_h = 16 if small_tiles() else min(1024, next_pow2(H))
    _sum_choices_kernel[(TK // top_k, cdiv(H, block_h))](rows, out, H, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out


def default_configs(num_rows: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """(gate/up config, down config) for a batch of `num_rows` = T*k rows; tiles measured on an
    H200 (docs/benchmarks.md, "Kernels"); fp32 (numerics tests) gets small ones."""
    if small_tiles():
        c = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1, "num_stages": 1}
        return c, c
    if dtype == torch.float32:
        m = 16 if num_rows <= 16 * num_experts else 64
        c = {"BLOCK_M": m, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}
        return c, c
    if num_rows <= 16 * num_experts:  # decode: a handful of rows per expert, bound by weight reads
        up = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
        down = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
        return up, down
    # prefill: expert weights by TMA (sm_90+; pointer loads elsewhere), faster than pointer loads
    up = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True}
    down = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True}
    return up, down


PREFILL_CANDIDATES = [  # (gate/up, down) pairs
    (
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    ),
    (
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
    ),
    (
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3},
    ),
    (
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    ),
    # expert weights through TMA descriptors
    (
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True},
    ),
    (
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "TMA": True},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "TMA": True},
    ),
    (
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": True},
    ),
    (
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 4, "TMA": True},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 4, "TMA": True},
    ),
]


def _weight_desc(w: torch.Tensor, cfg: dict):
    """A TMA descriptor over the expert weights viewed as [E * rows, K], for configs that ask for
    one (`TMA`) on a GPU with TMA (sm_90+) or in the interpreter; None: pointer loads (and for FP8
    weights, whose tiles are converted before the dot)."""
    if not cfg.get("TMA") or not w.is_contiguous() or (w.shape[-1] * w.element_size()) % 16 or w.element_size() == 1:
        return None
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] < 9:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = w.view(-1, w.shape[-1])
    return TensorDescriptor.from_tensor(flat, [cfg["BLOCK_N"], cfg["BLOCK_K"]])


def _launch(kernel, cfg: dict, num_m: int, n: int, *args, **kwargs) -> None:
    grid = (num_m * cdiv(n, cfg["BLOCK_N"]),)
    kernel[grid](
        *args, **kwargs,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def fused_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int
    *,
    configs: tuple[dict, dict] | None = None,
    w13_scale: torch.Tensor | None = None,  # FP8 weights: [E, 2 * ceil(I / bn), ceil(H / bk)] (gate, then up)
    w2_scale: torch.Tensor | None = None,  # [E, ceil(H / bn), ceil(I / bk)]
    fp8_block: tuple[int, int] = (128, 128),  # (bn, bk)
) -> torch.Tensor:  # [T, H]
    """The routed experts' SwiGLU over each token's k choices, weighted and summed. FP8 expert
    weights (`w13_scale`, `w2_scale` given) are read as they are stored, half the bytes of bf16,
    and dequantized tile by tile (a K tile must not straddle a scale block)."""
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    rows = T * k
    if T == 0:
        return torch.empty_like(hidden)
    assert hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    up_cfg, down_cfg = configs or default_configs(rows, E, hidden.dtype)
    if up_cfg["BLOCK_M"] != down_cfg["BLOCK_M"]:
        raise ValueError("both GEMMs walk the same expert blocks: BLOCK_M must match")
    fp8 = w13_scale is not None
    bn, bk = fp8_block if fp8 else (0, 0)
    if fp8:
        if w2_scale is None:
            raise ValueError("FP8 experts need both w13_scale and w2_scale")
        # a K tile inside one scale block (block sizes are powers of two)
        up_cfg, down_cfg = ({**c, "BLOCK_K": min(c["BLOCK_K"], bk)} for c in (up_cfg, down_cfg))
        if bk % up_cfg["BLOCK_K"] or bk % down_cfg["BLOCK_K"]:
            raise ValueError(
                f"FP8 block {fp8_block}: K tiles of {up_cfg['BLOCK_K']} / {down_cfg['BLOCK_K']} straddle it"
            )
    s13 = w13_scale if fp8 else w13  # a pointer the kernels never read without FP8
    s2 = w2_scale if fp8 else w2
    sorted_ids, expert_ids, npad = moe_align(topk_ids, E, up_cfg["BLOCK_M"])
    num_m = expert_ids.numel()
    act = torch.empty((rows, inter), dtype=hidden.dtype, device=hidden.device)
    up_desc, down_desc = _weight_desc(w13, up_cfg), _weight_desc(w2, down_cfg)
    _launch(
        _gate_up_kernel, up_cfg, num_m, inter,
        hidden, w13, up_desc, s13, act, sorted_ids, expert_ids, npad, rows, num_m, H, inter, k,
        hidden.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), act.stride(0), SCALE_N=bn,
        SCALE_K=bk, EVEN_K=H % up_cfg["BLOCK_K"] == 0, IEEE=ieee(hidden), USE_TMA=up_desc is not None,
    )  # fmt: skip
    out = torch.empty((rows, H), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    _launch(
        _down_kernel, down_cfg, num_m, H,
        act, w2, down_desc, s2, out, weights, sorted_ids, expert_ids, npad, rows, num_m, inter, H,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), SCALE_N=bn, SCALE_K=bk,
        EVEN_K=inter % down_cfg["BLOCK_K"] == 0, IEEE=ieee(hidden), USE_TMA=down_desc is not None,
    )  # fmt: skip
    return sum_choices(out, k)
