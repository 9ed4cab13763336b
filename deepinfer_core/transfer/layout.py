"""The KV layout of an engine and its fingerprint.

Two engines can exchange KV blocks only if their blocks mean the same thing: same model,
dtype, block size, layer count and per-layer block shape. The fingerprint of that tuple
travels with every KV target; a mismatch is refused before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

LAYOUT_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    model: str
    """Architecture plus a digest of the model config (paths may differ between hosts)."""
    dtype: str
    block_size: int
    num_layers: int
    block_shape: tuple[int, ...]
    """One layer's block, e.g. (2, block_size, kv_heads, head_dim) or (block_size, latent_dim)."""
    block_bytes: int
    """Bytes of one (layer, block) region."""

    @property
    def fingerprint(self) -> str:
        canon = json.dumps({"v": LAYOUT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:20]

    def describe(self) -> str:
        return (
            f"{self.model} {self.dtype} block_size={self.block_size} layers={self.num_layers} "
            f"block_shape={list(self.block_shape)}"
        )

    @classmethod
    def of(cls, hf_config: dict, kv_buffer, block_size: int) -> KVLayout:
        """The layout of a cache buffer `[num_layers, num_blocks, *block_shape]` for a model config."""
        arch = (hf_config.get("architectures") or [hf_config.get("model_type", "unknown")])[0]
        digest = hashlib.sha256(json.dumps(_model_identity(hf_config), sort_keys=True).encode()).hexdigest()[:12]
        block_shape = tuple(int(d) for d in kv_buffer.shape[2:])
        return cls(
            model=f"{arch}:{digest}",
            dtype=str(kv_buffer.dtype).removeprefix("torch."),
            block_size=int(block_size),
            num_layers=int(kv_buffer.shape[0]),
            block_shape=block_shape,
            block_bytes=int(kv_buffer[0, 0].numel() * kv_buffer.element_size()),
        )


def _model_identity(hf_config: dict) -> dict:
    """The config keys that decide what a KV block holds (not names, paths or generation defaults)."""
    keys = (
        "architectures",
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "rope_theta",
        "rope_scaling",
    )
    identity = {k: hf_config.get(k) for k in keys if k in hf_config}
    if isinstance(hf_config.get("text_config"), dict):  # multimodal wrappers: the language model decides the KV
        identity["text_config"] = _model_identity(hf_config["text_config"])
    return identity
