"""DeepSeek-V3's multi-token-prediction (MTP) module, run as the draft model of speculative decoding.

    token t_{p+1}, target hidden h_p  (h: the target's last hidden state, after its final norm)
      e = enorm(embed(t_{p+1}))     g = hnorm(h_p)
      x = eh_proj([e ; g])                          # [T, 2H] -> [T, H]
      x = decoder block (MLA attention over its own paged KV, MoE or dense MLP) + residual
      logits = shared_head.head(shared_head.norm(x))  # the draft of t_{p+2}

A V3 checkpoint stores it as layer `model.layers.<num_hidden_layers>.*` (`num_nextn_predict_layers`
= 1): the decoder block's tensors under their usual names plus `enorm`, `hnorm`, `eh_proj`,
`shared_head.{norm,head}` and `embed_tokens`. Drafting k > 1 tokens chains the one layer: its
output `x` stands in for the next position's `h` (as vLLM and SGLang do). The target's own
`DeepseekV3ForCausalLM` skips these tensors; only an engine that drafts loads them (`load_mtp`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer_core.models.deepseek_v3 import DeepseekArgs, _feed_forward
from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.layers.decoder import DecoderLayer
from deepinfer_core.models.layers.mla import MLAAttention
from deepinfer_core.models.layers.norm import RMSNorm
from deepinfer_core.models.layers.rotary import get_rope
from deepinfer_core.models.weights import expected_weight_names, load_weights_by_name

_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)


class DeepseekMTP(nn.Module):
    """One MTP layer over one extra paged KV layer (`num_kv_cache_layers` = 1)."""

    num_kv_cache_layers = 1

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        hf_config = normalize_hf_config(hf_config)
        args = DeepseekArgs.from_hf(hf_config)
        self.args = args
        self.layer_index = args.num_layers  # its index in the checkpoint
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, h, dtype=dtype)
        self.enorm = RMSNorm(h, args.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, args.rms_norm_eps, dtype=dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        ffn = _feed_forward(args, args.num_layers, dtype)  # V3's MTP layer is a MoE layer
        self.block = DecoderLayer(MLAAttention(args.mla, dtype), ffn, h, args.rms_norm_eps, dtype)
        self.shared_head = SharedHead(h, args.vocab_size, args.rms_norm_eps, dtype)
        self.rotary_emb = get_rope(hf_config, args.mla.qk_rope_head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the token after each position
        positions: torch.Tensor,  # [T] int64
        prev_hidden: torch.Tensor,  # [T, H]: the target's (or the previous draft's) hidden at each position
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: this layer's latent cache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]: pre-norm output, the next chained draft's `prev_hidden`
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(prev_hidden)], dim=-1))
        rope = self.rotary_emb(positions)
        x, residual = self.block(x, None, rope, kv_cache, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.shared_head.head(self.shared_head.norm(hidden)).float()

    def rename(self, name: str) -> str | None:
        """Canonical name of a checkpoint tensor of the MTP layer; None for every other tensor."""
        prefix = f"model.layers.{self.layer_index}."
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix) :]
        return "block." + rest if rest.startswith(_BLOCK_PARTS) else rest

    def load_weights(self, weights) -> set[str]:
        return load_weights_by_name(self, weights, self.rename)

    def expected_weight_names(self) -> list[str]:
        return expected_weight_names(self)

    def share_target_embeddings(self, target: nn.Module) -> None:
        """Use the target's embedding and head (V3 stores copies of both; the built-in model ties them)."""
        lm = getattr(target, "language_model", target)  # a LLaVA model drafts for its language model
        self.embed_tokens.weight = lm.model.embed_tokens.weight
        self.shared_head.head.weight = lm.lm_head.weight

    def keeps_fp8(self, name: str) -> bool:
        """As the target: from an FP8 checkpoint the routed experts stay FP8."""
        return self.args.fp8_block is not None and ".mlp.experts." in name
