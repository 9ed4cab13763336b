"""Paged attention over a block-table KV cache: the pure-torch reference.

Cache layout (per layer): `kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`;
index 0 of dim 1 holds keys, 1 values. One (layer, block) region is contiguous, so a
request's KV moves as one descriptor per layer and block.

A step feeds a flat batch of T new tokens from B sequences. Sequence b owns new tokens
`query_start_loc[b]:query_start_loc[b+1]`, which sit at context positions
`seq_lens[b] - query_len_b ... seq_lens[b] - 1`; everything before them is already in
the cache (prefix hits, earlier chunks, earlier decode steps). One code path covers
prefill, chunked prefill, prefix hits and decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; block * block_size + offset, -1 = skip
) -> None:
    """Write each new token's K and V into its cache slot."""
    num_blocks, _, block_size = kv_cache.shape[:3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat = kv_cache.view(num_blocks, 2, block_size, *kv_cache.shape[3:])
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    flat[blocks, 0, offsets] = key.to(kv_cache.dtype)
    flat[blocks, 1, offsets] = value.to(kv_cache.dtype)


def _gather_context(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int):
    """K and V of one sequence's first `seq_len` positions: two [seq_len, Hkv, D] tensors."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[block_table_row[:n_blocks].long()]  # [n, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(-1, *blocks.shape[3:])[:seq_len]
    v = blocks[:, 1].reshape(-1, *blocks.shape[3:])[:seq_len]
    return k, v


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_lens: list[int],  # host copy, B entries
    seq_lens: list[int],  # host copy, B entries (context incl. new tokens)
    scale: float,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context. Returns [T, Hq, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if all(q == 1 for q in query_lens) and len(query_lens) > 1:
        return _decode_batched(query, kv_cache, block_tables, seq_lens, scale, group)
    out = torch.empty_like(query)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        q = query[start : start + q_len]  # [q, Hq, D]
        k, v = _gather_context(kv_cache, block_tables[b], s_len)  # [s, Hkv, D]
        k = k.to(q.dtype).repeat_interleave(group, dim=1)
        v = v.to(q.dtype).repeat_interleave(group, dim=1)
        o = _causal_sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)  # [Hq, q, D]
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out.view(-1, num_heads, head_dim)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, q, D] at the last q positions of k/v [H, s, D]: query i sees keys <= s - q + i."""
    q_len, s_len = q.shape[1], k.shape[1]
    if q_len == 1:  # a decode token sees the whole context
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if q_len == s_len:  # no cached prefix: plain causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    q_pos = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
    mask = torch.arange(s_len, device=q.device)[None, :] <= q_pos  # [q, s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _decode_batched(query, kv_cache, block_tables, seq_lens, scale, group):
    """One new token per sequence: gather every context padded to the longest."""
    block_size = kv_cache.shape[2]
    max_len = max(seq_lens)
    n_blocks = (max_len + block_size - 1) // block_size
    lens = torch.tensor(seq_lens, device=query.device)
    return _grouped_decode(query, kv_cache, block_tables[:, :n_blocks], lens, scale, group, max_len)


def _grouped_decode(query, kv_cache, block_tables, seq_lens, scale, group, max_len=None):
    """Decode attention without expanding K/V per query head: the `group` query heads that
    share a KV head are laid out as that head's query rows. query [B, Hq, D] -> [B, Hq, D]."""
    B, W = block_tables.shape
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    S = W * block_size if max_len is None else max_len
    idx = block_tables.long()  # K and V gathered apart, each straight into its contiguous [B, W, bs, Hkv, D]
    k = kv_cache[idx, 0].view(B, W * block_size, num_kv_heads, head_dim)[:, :S]
    v = kv_cache[idx, 1].view(B, W * block_size, num_kv_heads, head_dim)[:, :S]
    k = k.to(query.dtype).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.to(query.dtype).transpose(1, 2)
    q = query.view(B, num_kv_heads, group, head_dim)  # [B, Hkv, group, D]
    mask = torch.arange(S, device=query.device)[None, :] < seq_lens[:, None]  # [B, S]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(B, num_kv_heads * group, head_dim)


def paged_decode_attention_static(
    query: torch.Tensor,  # [B, Hq, D], one new token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32, fixed width W
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:
    """Decode attention with shapes fixed by (B, W) and no host synchronisation, so it can
    be captured in a CUDA graph: every sequence gathers all W blocks and masks past its length."""
    group = query.shape[1] // kv_cache.shape[3]
    return _grouped_decode(query, kv_cache, block_tables, seq_lens, scale, group)


def reshape_and_cache_static(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`reshape_and_cache` without the padding filter (no host sync); padding must target a scratch slot."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)
