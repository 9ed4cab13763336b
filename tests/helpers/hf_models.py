"""Tiny random HF transformers models, saved as real checkpoints, for numerics and loader tests.

HF's own init leaves norms at one and biases at zero, which would let a model that forgot a
norm weight or a bias still match. `build_hf_model` redraws every parameter from a seeded
generator instead, so each one matters for the logits.

    hf = save_hf_checkpoint("qwen3", tmp_path / "ckpt")        # random tiny Qwen3, safetensors
    ref = hf_logits(hf, token_ids)                            # [len, vocab] fp32 reference
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.hf_config import load_hf_config

# family -> (config class, model class) names in transformers
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# rope scaling for a tiny model: the llama3 bands fall inside head_dim=16's wavelengths
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def tiny_hf_config(family: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A small config of `family` ("llama", "mistral", "qwen2", "qwen3"); overrides win."""
    config_cls = getattr(transformers, FAMILIES[family][0])
    kwargs = {**TINY, **overrides}
    if family == "mistral":
        kwargs.setdefault("sliding_window", None)
    return config_cls(**kwargs)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Redraw every parameter: normal(0, std) matrices, 1 + noise norms, noise biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("bias"):
                param.copy_(std * noise)
            elif param.dim() == 1:
                param.copy_(1.0 + std * noise)
            else:
                param.copy_(std * noise)


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random tiny HF model of `family` in fp32, eval mode."""
    config = tiny_hf_config(family, **overrides)
    model = getattr(transformers, FAMILIES[family][1])(config)
    randomize_(model, seed)
    return model.eval()


def save_hf_checkpoint(
    family: str,
    directory: str | os.PathLike,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Build a random tiny model and `save_pretrained` it as safetensors (sharded when
    `max_shard_size` is given, e.g. "100KB"); returns the HF model."""
    model = build_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


def model_config_for(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32, max_model_len: int = 256
) -> ModelConfig:
    """The engine's ModelConfig for a saved checkpoint directory."""
    path = str(directory)
    return ModelConfig(path=path, hf_config=load_hf_config(path), dtype=dtype, max_model_len=max_model_len)


def hf_logits(model: transformers.PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """HF logits [len, vocab] (fp32) for every position of one sequence."""
    with torch.inference_mode():
        out = model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float()
