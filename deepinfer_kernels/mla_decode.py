"""MLA decode attention in absorbed form over the latent cache: the pure-torch reference.

DeepSeek-V2/V3 cache one latent row per token, `[c_kv (kv_lora_rank) | k_pe (rope dim)]`,
shared by all heads: layer cache `latent_cache[num_blocks, block_size, kv_lora_rank + rope]`.
With W_UK absorbed into the query (`q_nope_absorbed = q_nope @ W_UK`, [B, H, kv_lora_rank]),
every head attends over the latent rows directly: score = q_nope_absorbed·c_kv + q_pe·k_pe,
value = c_kv. The output stays in latent space, [B, H, kv_lora_rank]; the caller applies W_UV.
`scale` is the softmax scale of the unabsorbed head dim (qk_nope + qk_rope, YaRN mscale folded in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_decode_attention_ref(
    q_nope: torch.Tensor,  # [B, H, kv_lora_rank], absorbed
    q_pe: torch.Tensor,  # [B, H, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, H, kv_lora_rank]
    B, W = block_tables.shape
    lora = q_nope.shape[-1]
    page = latent_cache.shape[1]
    rows = latent_cache[block_tables.long()].reshape(B, 1, W * page, -1).to(q_nope.dtype)  # [B, 1, S, L+R]
    q = torch.cat([q_nope, q_pe], dim=-1)[:, None]  # [B, 1, H, L+R]: the heads are one MQA head's rows
    mask = torch.arange(W * page, device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    o = F.scaled_dot_product_attention(q, rows, rows[..., :lora], attn_mask=mask[:, None, None, :], scale=scale)
    return o[:, 0]
