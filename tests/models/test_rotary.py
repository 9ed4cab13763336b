"""RoPE frequencies and rotation against transformers' own RoPE code, for every scaling type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    get_rope,
    rope_inv_freq,
    rope_max_positions,
    rope_parameters,
)

HEAD_DIM = 32
MAX_POS = 256
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
        "truncate": False,
    },
    "yarn_no_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
}


def _hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": 5000.0, **rope},
    )


def _hf_inv_freq(config: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def _ours(config: LlamaConfig) -> dict:
    return normalize_hf_config(config.to_dict())


@pytest.mark.parametrize("name", ROPES)
def test_inv_freq_and_attention_factor_match_hf(name: str) -> None:
    config = _hf_config(ROPES[name])
    ref_inv_freq, ref_factor = _hf_inv_freq(config)
    inv_freq, factor = rope_inv_freq(rope_parameters(_ours(config)), HEAD_DIM, MAX_POS)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("name", ROPES)
def test_cos_sin_match_hf_rotary_embedding(name: str) -> None:
    config = _hf_config(ROPES[name])
    positions = torch.tensor([0, 1, 5, 63, 64, 100, MAX_POS - 1])
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = get_rope(_ours(config), HEAD_DIM)(positions)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos, ref_cos[0, :, :half], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0, :, :half], rtol=1e-5, atol=1e-5)


def test_dynamic_past_max_positions_matches_hf_cached_generation() -> None:
    """HF rotates the newest token at position p with the base for length p + 1."""
    config = _hf_config(ROPES["dynamic"])
    rope = get_rope(_ours(config), HEAD_DIM)
    assert rope.max_positions == 2 * MAX_POS
    for p in (MAX_POS, MAX_POS + 1, 2 * MAX_POS - 1):
        hf_rope = LlamaRotaryEmbedding(config)
        ref_cos, ref_sin = hf_rope(torch.zeros(1), torch.arange(p + 1)[None])
        cos, sin = rope(torch.tensor([p]))
        torch.testing.assert_close(cos[0], ref_cos[0, -1, : HEAD_DIM // 2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sin[0], ref_sin[0, -1, : HEAD_DIM // 2], rtol=1e-4, atol=1e-4)


def test_apply_rotary_matches_hf_rotate_half() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, HEAD_DIM, generator=gen)  # [T, H, D]
    k = torch.randn(7, 2, HEAD_DIM, generator=gen)
    config = _hf_config(ROPES["llama3"])
    positions = torch.arange(3, 10)
    cos, sin = get_rope(_ours(config), HEAD_DIM)(positions)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos[0], ref_sin[0], unsqueeze_dim=1)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k, rtol=1e-5, atol=1e-5)


def test_legacy_rope_scaling_and_rope_parameters_agree() -> None:
    legacy = {"max_position_embeddings": 128, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 4}}
    modern = {
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "linear", "factor": 4, "rope_theta": 500.0},
    }
    assert rope_parameters(legacy) == rope_parameters(modern)
    assert rope_parameters(legacy) == {"rope_type": "linear", "factor": 4, "rope_theta": 500.0}
    assert rope_parameters({"max_position_embeddings": 8}) == {"rope_type": "default", "rope_theta": 10000.0}


def test_table_covers_the_scaled_context() -> None:
    assert rope_max_positions({"rope_type": "default"}, 100) == 100
    assert rope_max_positions({"rope_type": "linear", "factor": 2.0}, 100) == 200
    params = rope_parameters({"max_position_embeddings": 100, "rope_scaling": ROPES["yarn"]})
    assert rope_max_positions(params, 100) == 256
    rope = RotaryEmbedding(HEAD_DIM, params, 100)
    assert rope.cos_sin.shape == (256, HEAD_DIM) and rope.cos_sin.dtype == torch.float32


@pytest.mark.parametrize("rope_type", ["longrope", "made_up"])
def test_unknown_rope_type_is_named(rope_type: str) -> None:
    config = {"max_position_embeddings": 64, "rope_scaling": {"type": rope_type, "factor": 2.0}}
    with pytest.raises(ValueError, match=rope_type):
        get_rope(config, HEAD_DIM)
    with pytest.raises(ValueError, match=rope_type):
        rope_inv_freq(rope_parameters(config), HEAD_DIM, 64)
