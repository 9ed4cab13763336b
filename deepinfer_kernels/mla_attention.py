"""Multi-head latent attention (MLA) over a paged latent cache: the pure-torch reference.

Cache layout (per layer): `latent_cache[num_blocks, block_size, kv_lora_rank + rope_dim]`.
Each token stores one vector: its normalised compressed KV `c` (kv_lora_rank values) followed
by its rotated RoPE key `k_pe` (rope_dim values), shared by every head. That vector is all the
KV a token has: per-head keys and values are `c` times the up-projection `W_kv_b`.

Two ways to attend, equal up to rounding:
- naive (prefill): expand the context's latents into per-head keys `[k_nope, k_pe]` and values
  with `W_kv_b`, then ordinary attention. Cheap in FLOPs for long queries.
- absorbed (decode): fold `W_UK` into the query (`q_lat = q_nope @ W_UK`), attend over the
  latents directly as multi-query attention with one KV "head" of width kv_lora_rank + rope_dim,
  and apply `W_UV` to the latent output afterwards. Reads only the compressed cache.

A step's layout is the same as in `paged_attention`: sequence b feeds `query_lens[b]` new tokens
at the end of its `seq_lens[b]`-token context. One-token-per-sequence decode with fixed shapes
(batched decode, CUDA graphs) is `mla_decode.mla_decode_attention_ref`, the reference of the
Triton decode kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_kernels.mla_decode import mla_decode_attention_ref


def write_latent_cache(
    latent: torch.Tensor,  # [T, L + R]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
    static: bool = False,  # no padding filter (no host sync); padding must target a scratch slot
) -> None:
    """Store each new token's latent vector in its cache slot."""
    if not static:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            latent, slot_mapping = latent[valid], slot_mapping[valid]
    block_size = latent_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    latent_cache[blocks, slot_mapping % block_size] = latent.to(latent_cache.dtype)


def gather_latents(latent_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, L + R]: the latents of one sequence's first `seq_len` positions."""
    block_size = latent_cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    return latent_cache[block_table_row[:n_blocks].long()].reshape(-1, latent_cache.shape[-1])[:seq_len]


def _causal_mask(q_len: int, s_len: int, device: torch.device) -> torch.Tensor | None:
    """[q, s] bool: query i (at position s - q + i) sees keys <= its position; None for decode."""
    if q_len == 1:
        return None
    q_pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]
    return torch.arange(s_len, device=device)[None, :] <= q_pos


def mla_attention_naive(
    q_nope: torch.Tensor,  # [T, Hq, Dn]
    q_pe: torch.Tensor,  # [T, Hq, R]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    w_kv_b: torch.Tensor,  # [Hq, Dn + Dv, L]: kv_b_proj's weight, per head
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Expand each sequence's latent context into per-head K/V, then causal attention."""
    heads, dn = q_nope.shape[1], q_nope.shape[2]
    rank = w_kv_b.shape[-1]
    dv = w_kv_b.shape[1] - dn
    out = q_nope.new_empty(q_nope.shape[0], heads, dv)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        ctx = gather_latents(latent_cache, block_tables[b], s_len).to(q_nope.dtype)  # [S, L + R]
        c, k_pe = ctx[:, :rank], ctx[:, rank:]  # [S, L], [S, R]
        kv = torch.einsum("sl,hdl->hsd", c, w_kv_b)  # [Hq, S, Dn + Dv]
        k = torch.cat([kv[..., :dn], k_pe[None].expand(heads, -1, -1)], dim=-1)  # [Hq, S, Dn + R]
        v = kv[..., dn:]  # [Hq, S, Dv]
        q = torch.cat([q_nope[start : start + q_len], q_pe[start : start + q_len]], dim=-1).transpose(0, 1)
        mask = _causal_mask(q_len, s_len, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [Hq, q, Dv]
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def mla_attention_absorbed(
    q_latent: torch.Tensor,  # [T, Hq, L]: q_nope already multiplied by W_UK
    q_pe: torch.Tensor,  # [T, Hq, R]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [T, Hq, L]: attention-weighted latents (W_UV not yet applied)
    """Attention straight over the latent cache: MQA whose one key is [c, k_pe] and value is c."""
    if len(query_lens) > 1 and all(q == 1 for q in query_lens):  # decode: one padded batch
        width = (max(seq_lens) + latent_cache.shape[1] - 1) // latent_cache.shape[1]
        lens = torch.tensor(seq_lens, device=q_latent.device)
        return mla_decode_attention_ref(q_latent, q_pe, latent_cache, block_tables[:, :width], lens, scale)
    rank = q_latent.shape[-1]
    q_full = torch.cat([q_latent, q_pe], dim=-1)  # [T, Hq, L + R]
    out = q_latent.new_empty(q_latent.shape)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        ctx = gather_latents(latent_cache, block_tables[b], s_len).to(q_full.dtype)  # [S, L + R]
        q = q_full[start : start + q_len].transpose(0, 1)  # [Hq, q, L + R]
        mask = _causal_mask(q_len, s_len, q.device)
        o = F.scaled_dot_product_attention(q, ctx[None], ctx[None, :, :rank], attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)  # o: [Hq, q, L]
        start += q_len
    return out
