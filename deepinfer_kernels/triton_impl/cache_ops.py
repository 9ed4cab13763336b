"""KV-cache writes (reshape_and_cache) and block copies."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.triton_impl.common import cdiv, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    HKV,
    D,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < HKV) & (offs[None, :] < D)
    dst = (
        cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + heads[:, None] * stride_ch + offs[None, :]
    )
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs[None, :], mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    T, hkv, d = key.shape
    if T == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "cache rows must be contiguous"
    _reshape_and_cache_kernel[(T,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        hkv, d, PAGE=kv_cache.shape[2], BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), num_warps=4,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(buf_ptr, src_ptr, dst_ptr, stride_l, stride_b, NUMEL, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    base = buf_ptr + layer * stride_l
    tl.store(base + dst * stride_b + offs, tl.load(base + src * stride_b + offs, mask=mask), mask=mask)


def copy_blocks(kv_buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    P = src.numel()
    if P == 0:
        return
    L, N = kv_buffer.shape[:2]
    numel = kv_buffer[0, 0].numel()
    assert kv_buffer[0, 0].is_contiguous(), "each (layer, block) region must be contiguous"
    block = min(next_pow2(numel), 4096)
    grid = (P, L, cdiv(numel, block))
    _copy_blocks_kernel[grid](kv_buffer, src, dst, kv_buffer.stride(0), kv_buffer.stride(1), numel, BLOCK=block)
