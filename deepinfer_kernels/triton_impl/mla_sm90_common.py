"""What the sm_90 MLA decode kernels (Gluon) share: names that differ between Triton releases, and
the `cp.async` gather of latent rows through the block table."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import tma

# Triton 3.6 names the cp.async gather and the TMA load `async_copy_global_to_shared`, the TMA store
# `async_copy_shared_to_global` and the CTA barrier `thread_barrier`; later releases `async_load`,
# `async_store` and `barrier`.
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# A shared-memory view under another shape and layout: `_reinterpret` in 3.6, `reinterpret` later.
PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


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


def sm90_latent_operands(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """What every sm_90 MLA kernel needs: a Hopper GPU, 16-bit operands of one dtype, DeepSeek's latent
    dims (512 + 64), and 16-byte aligned cache rows for `cp.async`."""
    if not q_nope.is_cuda or torch.cuda.get_device_capability(q_nope.device) != (9, 0):
        return False
    return (
        q_nope.dtype in (torch.bfloat16, torch.float16)
        and q_pe.dtype == latent_cache.dtype == q_nope.dtype
        and q_nope.shape[-1] == 512
        and q_pe.shape[-1] == 64
        and latent_cache.stride(1) % 8 == 0
        and latent_cache.stride(0) % 8 == 0
    )
