"""DeepSeek-V3/V2 (MLA + DeepSeekMoE), Qwen3-MoE and Mixtral logits against HF transformers.

Each case saves a random tiny HF model as a real checkpoint (every parameter and the routers'
score-correction biases redrawn, so each one matters), loads it with `load_model` and compares
prefill, decode (MLA: the absorbed path) and mixed flat batches over the paged cache with HF's
full-sequence logits. fp32 tolerance: atol 1e-4 (observed ~2e-6 on logits of magnitude ~3).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.loader import load_model
from tests.helpers.hf_models import DEEPSEEK_YARN, model_config_for, save_hf_checkpoint
from tests.helpers.numerics import (
    assert_bf16_close,
    assert_decode_matches,
    assert_mixed_batch_matches,
    assert_prefill_matches,
    random_prompt,
)

ATOL = 1e-4

CASES = {
    "deepseek_v3": dict(family="deepseek_v3"),
    "deepseek_v3_yarn": dict(family="deepseek_v3", rope_parameters=dict(DEEPSEEK_YARN)),
    "deepseek_v3_neox_rope_tied": dict(family="deepseek_v3", rope_interleave=False, tie_word_embeddings=True),
    "deepseek_v2_lite": dict(family="deepseek_v2"),
    "qwen3_moe_sharded": dict(family="qwen3_moe", max_shard_size="60KB"),
    "mixtral": dict(family="mixtral"),
}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(HF reference model, our fp32 model, checkpoint directory) of one case."""
    kwargs = dict(CASES[request.param])
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(kwargs.pop("family"), directory, seed=len(request.param), **kwargs)
    if "max_shard_size" in kwargs:  # the case must really load through the index
        assert (directory / "model.safetensors.index.json").exists()
        assert len(list(directory.glob("*.safetensors"))) > 1
    return hf, load_model(model_config_for(directory), "cpu"), directory


@pytest.mark.parametrize("length", [1, 13])
def test_prefill_matches_hf(models, length: int) -> None:
    hf, ours, _ = models
    assert_prefill_matches(hf, ours, random_prompt(length, seed=length), ATOL)


def test_decode_steps_match_hf(models) -> None:
    hf, ours, _ = models
    assert_decode_matches(hf, ours, ATOL)


def test_mixed_batch_with_cached_prefix_matches_hf(models) -> None:
    hf, ours, _ = models
    assert_mixed_batch_matches(hf, ours, ATOL)


def test_bf16_close_to_hf_bf16(models) -> None:
    hf, _, directory = models
    ours = load_model(model_config_for(directory, dtype=torch.bfloat16), "cpu")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert_bf16_close(hf, ours, random_prompt(24, seed=6))
