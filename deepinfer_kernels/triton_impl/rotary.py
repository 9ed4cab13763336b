"""Neox-style rotary embedding: one program per (token, block of heads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, next_pow2


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    H,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < HALF
    mask = (heads[:, None] < H) & dmask[None, :]
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    # cos/sin are cast to x's dtype and every product and sum is rounded to it, as in torch.
    c = tl.load(cos_ptr + t * stride_ct + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (a * c).to(dt).to(tl.float32) - (b * s).to(dt).to(tl.float32)
    o2 = (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)
    o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(o_row, o1.to(dt), mask=mask)
    tl.store(o_row + HALF, o2.to(dt), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    half = D // 2
    block_d = next_pow2(half)
    block_h = min(next_pow2(H), max(1, 4096 // block_d))
    grid = (T, cdiv(H, block_h))
    _rotary_kernel[grid](
        x, cos, sin, out,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        H, half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out
