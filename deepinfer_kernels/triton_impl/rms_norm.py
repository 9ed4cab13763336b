"""Fused RMSNorm (+ residual add), one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    H,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * inv).to(x.dtype)  # cast back to the activation dtype before the weight, as HF
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape, H = x.shape, x.shape[-1]
    x2 = _rows(x)
    act_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, act_dtype), device=x.device)
    out2 = out.view(-1, H)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(shape, dtype=act_dtype, device=x.device)
        ro2 = res_out.view(-1, H)
    else:
        r2, ro2, res_out = x2, out2, None
    rows = x2.shape[0]
    if rows:
        block = next_pow2(H)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, ro2,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            H, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return out if residual is None else (out, res_out)
