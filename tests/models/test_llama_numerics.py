"""Llama-family logits through the paged cache against HF transformers on identical random weights.

Each case saves a random tiny HF model as a real checkpoint, loads it with `load_model`, and
compares logits of prefill, decode and mixed flat batches with HF's full-sequence logits.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.loader import load_model
from tests.helpers.hf_models import LLAMA3_ROPE, model_config_for, save_hf_checkpoint
from tests.helpers.numerics import (
    assert_bf16_close,
    assert_decode_matches,
    assert_mixed_batch_matches,
    assert_prefill_matches,
    random_prompt,
)

ATOL = 1e-4  # fp32; observed differences are ~3e-6 on logits of magnitude ~3

CASES = {
    "llama": dict(family="llama"),
    "llama_llama3_tied": dict(family="llama", rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True),
    "llama_biases": dict(family="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(family="mistral"),
    "qwen2_bias": dict(family="qwen2"),
    "qwen2_tied": dict(family="qwen2", tie_word_embeddings=True),
    "qwen3_sharded": dict(family="qwen3", max_shard_size="40KB"),
}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(HF reference model, our fp32 model, checkpoint directory) of one case."""
    kwargs = dict(CASES[request.param])
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(kwargs.pop("family"), directory, seed=len(request.param), **kwargs)
    return hf, load_model(model_config_for(directory), "cpu"), directory


def test_sharded_case_really_is_sharded(tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("shards")
    save_hf_checkpoint("qwen3", directory, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("length", [1, 6, 13])
def test_prefill_matches_hf(models, length: int) -> None:
    hf, ours, _ = models
    assert_prefill_matches(hf, ours, random_prompt(length, seed=length), ATOL)


def test_decode_steps_match_hf(models) -> None:
    """Two sequences prefill together, then decode six greedy tokens each, one per step."""
    hf, ours, _ = models
    assert_decode_matches(hf, ours, ATOL)


def test_mixed_batch_with_cached_prefix_matches_hf(models) -> None:
    """One flat batch: a fresh prompt, the rest of a sequence whose prefix is cached, a 1-token prompt."""
    hf, ours, _ = models
    assert_mixed_batch_matches(hf, ours, ATOL)


def test_bf16_close_to_hf_bf16(models) -> None:
    """bf16 logits stay within 3% of the fp32 logit range of HF bf16, and our bf16 error against
    fp32 is no more than twice HF's own bf16 error (plus 0.5% of the range)."""
    hf, _, directory = models
    ours = load_model(model_config_for(directory, dtype=torch.bfloat16), "cpu")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert_bf16_close(hf, ours, random_prompt(24, seed=6))
