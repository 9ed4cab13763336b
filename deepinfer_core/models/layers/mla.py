"""Multi-head latent attention (DeepSeek-V2/V3) over the compressed latent cache.

Per token the cache keeps `kv_lora_rank + qk_rope_head_dim` values (see `deepinfer_kernels.mla_attention`),
instead of 2 * heads * head_dim for ordinary attention. Parameter names are HF's:

    q:   q_proj                                   (no q_lora_rank, e.g. V2-Lite)
         q_a_proj -> q_a_layernorm -> q_b_proj    (q_lora_rank set)
    kv:  kv_a_proj_with_mqa -> [c | k_pe];  c -> kv_a_layernorm;  kv_b_proj: c -> [k_nope | v] per head
    out: o_proj

Prefill and mixed steps expand the latents (naive path); decode-only steps fold kv_b_proj into
the query and output (absorbed path) and read nothing but the latent cache; on CUDA that decode
runs `deepinfer_kernels.ops.mla_decode_attention` (Triton). `path` pins one path for every step ("naive" /
"absorbed"); "auto" is the engine's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.layers.norm import RMSNorm
from deepinfer_core.models.layers.rotary import apply_rotary
from deepinfer_kernels import ops
from deepinfer_kernels.mla_attention import mla_attention_absorbed, mla_attention_naive, write_latent_cache
from deepinfer_kernels.mla_decode import mla_decode_attention_ref
from deepinfer_kernels.registry import use_triton

MLA_PATHS = ("auto", "naive", "absorbed")


@dataclass(frozen=True)
class MLAArgs:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope_interleave: bool  # RoPE pairs are adjacent (x0, x1), (x2, x3), ... as DeepSeek trains them
    scale: float  # softmax scale: qk_head_dim^-0.5, times YaRN's mscale^2 where configured


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] with pairs (x0, x1), (x2, x3) -> [x0, x2, ..., x1, x3, ...], the layout neox
    rotation expects. Queries and keys are permuted alike, so their dot products are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, args: MLAArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        h, n = args.hidden_size, args.num_heads
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * self.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=args.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, dtype=dtype)
            self.q_b_proj = nn.Linear(args.q_lora_rank, n * self.qk_head_dim, bias=False, dtype=dtype)
        latent = args.kv_lora_rank + args.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(h, latent, bias=args.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = nn.Linear(
            args.kv_lora_rank, n * (args.qk_nope_head_dim + args.v_head_dim), bias=False, dtype=dtype
        )
        self.o_proj = nn.Linear(n * args.v_head_dim, h, bias=args.attention_bias, dtype=dtype)
        self.path = "auto"

    def kv_cache_block_shape(self, block_size: int) -> tuple[int, ...]:
        return (block_size, self.args.kv_lora_rank + self.args.qk_rope_head_dim)

    def _w_kv_b(self) -> torch.Tensor:  # [Hq, Dn + Dv, L]
        a = self.args
        return self.kv_b_proj.weight.view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)

    def _query(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, Hq, Dn + R]
        q = self.q_proj(x) if self.args.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.args.num_heads, self.qk_head_dim)

    def _use_absorbed(self, meta: AttentionMetadata) -> bool:
        if self.path == "auto":
            return meta.is_decode_only or meta.static_shapes
        return self.path == "absorbed"

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, R/2] each
        latent_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        a, T = self.args, x.shape[0]
        q_nope, q_pe = self._query(x).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)  # [T, L], [T, R]
        c = self.kv_a_layernorm(c)
        if a.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = apply_rotary(q_pe, *rope)  # [T, Hq, R]
        k_pe = apply_rotary(k_pe[:, None, :], *rope)[:, 0]  # [T, R]
        write_latent_cache(torch.cat([c, k_pe], dim=-1), latent_cache, meta.slot_mapping, static=meta.static_shapes)
        if self._use_absorbed(meta):
            o = self._absorbed(q_nope, q_pe, latent_cache, meta)
        else:
            o = mla_attention_naive(
                q_nope, q_pe, latent_cache, self._w_kv_b(), meta.block_tables, meta.query_lens_cpu,
                meta.seq_lens_cpu, a.scale,
            )  # fmt: skip
        return self.o_proj(o.reshape(T, a.num_heads * a.v_head_dim))

    def _absorbed(self, q_nope, q_pe, latent_cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, Hq, Dv]
        a = self.args
        w = self._w_kv_b()
        w_uk, w_uv = w[:, : a.qk_nope_head_dim], w[:, a.qk_nope_head_dim :]  # [Hq, Dn, L], [Hq, Dv, L]
        q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # [T, Hq, L]
        if use_triton(q_lat) and (meta.static_shapes or meta.is_decode_only):  # CUDA: the Triton decode kernel
            o_lat = ops.mla_decode_attention(q_lat, q_pe, latent_cache, meta.block_tables, meta.seq_lens, a.scale)
        elif meta.static_shapes:
            o_lat = mla_decode_attention_ref(q_lat, q_pe, latent_cache, meta.block_tables, meta.seq_lens, a.scale)
        else:
            o_lat = mla_attention_absorbed(
                q_lat, q_pe, latent_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, a.scale
            )
        return torch.einsum("thl,hvl->thv", o_lat, w_uv)  # [T, Hq, Dv]


def set_mla_path(model: nn.Module, path: str) -> None:
    """Pin every MLA layer of `model` to one attention path ("auto", "naive" or "absorbed")."""
    if path not in MLA_PATHS:
        raise ValueError(f"unknown MLA path {path!r}; choose one of {MLA_PATHS}")
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.path = path
