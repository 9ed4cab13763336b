"""Llama-family logits through the paged cache against HF transformers on identical random weights.

Each case saves a random tiny HF model as a real checkpoint, loads it with `load_model`, and
compares logits of prefill, decode and mixed flat batches with HF's full-sequence logits.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.loader import load_model
from tests.helpers.hf_models import LLAMA3_ROPE, hf_logits, model_config_for, save_hf_checkpoint
from tests.helpers.paged import PagedRunner

ATOL = 1e-4  # fp32; observed differences are ~3e-6 on logits of magnitude ~3
BLOCK_SIZE = 4

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


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sharded_case_really_is_sharded(tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("shards")
    save_hf_checkpoint("qwen3", directory, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("length", [1, 6, 13])
def test_prefill_matches_hf(models, length: int) -> None:
    hf, ours, _ = models
    prompt = _prompt(length, seed=length)
    (logits,) = PagedRunner(ours, BLOCK_SIZE).step([("s", prompt)])
    assert logits.shape == (length, 256) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_decode_steps_match_hf(models) -> None:
    """Two sequences prefill together, then decode six greedy tokens each, one per step."""
    hf, ours, _ = models
    runner = PagedRunner(ours, BLOCK_SIZE)
    seqs = {"a": _prompt(5, seed=1), "b": _prompt(9, seed=2)}
    outputs = {k: list(v) for k, v in zip(seqs, runner.step(list(seqs.items())), strict=True)}
    for _ in range(6):
        batch = [(k, [int(outputs[k][-1][-1].argmax())]) for k in seqs]
        for (k, token), logits in zip(batch, runner.step(batch), strict=True):
            seqs[k] += token
            outputs[k].append(logits[0])
    for k, tokens in seqs.items():
        ours_logits = torch.stack(outputs[k])  # [len - 1 + 1, V]: prompt rows, then one per step
        torch.testing.assert_close(ours_logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_mixed_batch_with_cached_prefix_matches_hf(models) -> None:
    """One flat batch: a fresh prompt, the rest of a sequence whose prefix is cached, a 1-token prompt."""
    hf, ours, _ = models
    runner = PagedRunner(ours, BLOCK_SIZE)
    cached = _prompt(12, seed=3)
    fresh, single = _prompt(10, seed=4), _prompt(1, seed=5)
    runner.step([("cached", cached[:7])])  # prefix written into its blocks by an earlier call
    out_fresh, out_rest, out_single = runner.step([("fresh", fresh), ("cached", cached[7:]), ("single", single)])
    torch.testing.assert_close(out_fresh, hf_logits(hf, fresh), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_rest, hf_logits(hf, cached)[7:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_single, hf_logits(hf, single), atol=ATOL, rtol=0)


def test_bf16_close_to_hf_bf16(models) -> None:
    """bf16 logits stay within 3% of the fp32 logit range of HF bf16, and our bf16 error against
    fp32 is no more than twice HF's own bf16 error (plus 0.5% of the range)."""
    hf, _, directory = models
    ours = load_model(model_config_for(directory, dtype=torch.bfloat16), "cpu")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    prompt = _prompt(24, seed=6)
    (logits,) = PagedRunner(ours, BLOCK_SIZE).step([("s", prompt)])
    ref32 = hf_logits(hf, prompt)
    ref16 = hf_logits(hf.to(torch.bfloat16), prompt)
    hf.float()  # the module-scoped reference is shared with later tests
    scale = ref32.abs().max()
    assert (logits - ref16).abs().max() <= 0.03 * scale
    assert (logits - ref32).abs().max() <= 2 * (ref16 - ref32).abs().max() + 0.005 * scale
