"""The public ops: each runs its Triton kernel or its pure-torch reference (`deepinfer_kernels.registry`).

Every op has the signature of its reference plus `backend` ("auto" | "torch" | "triton",
default: the registry's). The Triton paths never synchronise with the host and launch grids
that depend only on the tensors' shapes, so they can be captured in CUDA graphs.

| op | reference |
|---|---|
| `rms_norm` | `rms_norm.rms_norm_ref` |
| `rotary` | `rotary.rotary_ref` |
| `reshape_and_cache` | `paged_attention.reshape_and_cache` |
| `copy_blocks` | `cache_ops.copy_blocks_ref` |
| `paged_decode_attention` | `attention_refs.paged_decode_attention_ref` |
| `paged_prefill_attention` | `attention_refs.paged_prefill_attention_ref` |
| `mla_decode_attention` | `mla_decode.mla_decode_attention_ref` |
| `moe_topk`, `moe_align`, `fused_experts`, `fused_moe` | `fused_moe.*_ref` |
"""

from __future__ import annotations

import torch

from deepinfer_kernels import fused_moe as moe_refs
from deepinfer_kernels.attention_refs import paged_decode_attention_ref, paged_prefill_attention_ref
from deepinfer_kernels.cache_ops import copy_blocks_ref
from deepinfer_kernels.mla_decode import mla_decode_attention_ref
from deepinfer_kernels.paged_attention import reshape_and_cache as reshape_and_cache_ref
from deepinfer_kernels.registry import triton_module, use_triton
from deepinfer_kernels.rms_norm import rms_norm_ref
from deepinfer_kernels.rotary import rotary_ref


def rms_norm(x, weight, eps, residual=None, *, backend=None):
    """norm(x) * weight, or (norm(x + residual) * weight, x + residual). x: [..., H]."""
    if use_triton(x, backend):
        return triton_module("rms_norm").rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary(x, cos, sin, *, backend=None):
    """Neox rotation of x [T, H, D] by cos/sin [T, D/2] (rows of the model's table)."""
    if use_triton(x, backend):
        return triton_module("rotary").rotary(x, cos, sin)
    return rotary_ref(x, cos, sin)


def reshape_and_cache(key, value, kv_cache, slot_mapping, *, backend=None) -> None:
    """Write K/V [T, Hkv, D] into their cache slots; slot -1 skips the token."""
    if use_triton(key, backend):
        triton_module("cache_ops").reshape_and_cache(key, value, kv_cache, slot_mapping)
    else:
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)


def copy_blocks(kv_buffer, src, dst, *, backend=None) -> None:
    """Copy blocks src[i] -> dst[i] of every layer of kv_buffer [L, N, *block_shape]."""
    if use_triton(kv_buffer, backend):
        triton_module("cache_ops").copy_blocks(kv_buffer, src, dst)
    else:
        copy_blocks_ref(kv_buffer, src, dst)


def paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, *, backend=None) -> torch.Tensor:
    """One token per sequence over its paged context (GQA). query [B, Hq, D] -> [B, Hq, D]."""
    if use_triton(query, backend):
        return triton_module("decode_attention").paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_ref(query, kv_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    query, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, *, backend=None
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over cached prefix + themselves. [T, Hq, D]."""
    args = (query, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale)
    if use_triton(query, backend):
        return triton_module("prefill_attention").paged_prefill_attention(*args)
    return paged_prefill_attention_ref(*args)


def mla_decode_attention(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale, *, backend=None) -> torch.Tensor:
    """Absorbed MLA decode over the latent cache. -> [B, H, kv_lora_rank] (latent space)."""
    args = (q_nope, q_pe, latent_cache, block_tables, seq_lens, scale)
    if use_triton(q_nope, backend):
        return triton_module("mla_decode").mla_decode_attention(*args)
    return mla_decode_attention_ref(*args)


def moe_topk(router_logits, top_k, *, backend=None, **routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] fp32 and expert ids [T, k] int32; options: `fused_moe` module doc."""
    if use_triton(router_logits, backend):
        return triton_module("moe_routing").moe_topk(router_logits, top_k, **routing)
    return moe_refs.moe_topk_ref(router_logits, top_k, **routing)


def moe_align(topk_ids, num_experts, block_m, *, backend=None):
    """(sorted_ids, expert_ids, num_padded): rows grouped by expert in blocks of block_m."""
    if use_triton(topk_ids, backend):
        return triton_module("moe_routing").moe_align(topk_ids, num_experts, block_m)
    return moe_refs.moe_align_ref(topk_ids, num_experts, block_m)


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, *, backend=None, **fp8) -> torch.Tensor:
    """sum_k w[t,k] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[t,k]. hidden [T, H] -> [T, H].
    FP8 expert weights: `w13_scale=`, `w2_scale=`, `fp8_block=` (see `deepinfer_kernels.fp8`)."""
    if use_triton(hidden, backend):
        return triton_module("fused_moe").fused_experts(hidden, w13, w2, topk_weights, topk_ids, **fp8)
    return moe_refs.fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids, **fp8)


def fused_moe(hidden, w13, w2, router_logits, top_k, *, backend=None, **routing) -> torch.Tensor:
    """Route then run the experts: the whole routed-expert part of an MoE layer."""
    weights, ids = moe_topk(router_logits, top_k, backend=backend, **routing)
    return fused_experts(hidden, w13, w2, weights, ids, backend=backend)
