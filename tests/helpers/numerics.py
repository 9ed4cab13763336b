"""Logit checks of one of our models against the HF model it was loaded from, through the paged cache.

Each check feeds our model the way the runner does (flat batches over shuffled KV blocks) and
compares with HF's full-sequence logits of the same tokens:

    assert_prefill_matches(hf, ours, prompt, atol)      # one prompt in one step
    assert_decode_matches(hf, ours, atol)               # two prompts, then greedy decode steps
    assert_mixed_batch_matches(hf, ours, atol)          # fresh prompt + cached prefix + 1-token prompt
    assert_bf16_close(hf, ours_bf16, prompt)            # bf16 error no worse than HF's own
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.helpers.hf_models import hf_logits
from tests.helpers.paged import PagedRunner

BLOCK_SIZE = 4


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_prefill_matches(hf, ours: nn.Module, prompt: list[int], atol: float) -> None:
    (logits,) = PagedRunner(ours, BLOCK_SIZE).step([("s", prompt)])
    ref = hf_logits(hf, prompt)
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=atol, rtol=0)


def assert_decode_matches(hf, ours: nn.Module, atol: float, steps: int = 6) -> None:
    """Two sequences prefill together, then decode `steps` greedy tokens each, one per step."""
    runner = PagedRunner(ours, BLOCK_SIZE)
    seqs = {"a": random_prompt(5, seed=1), "b": random_prompt(9, seed=2)}
    outputs = {k: list(v) for k, v in zip(seqs, runner.step(list(seqs.items())), strict=True)}
    for _ in range(steps):
        batch = [(k, [int(outputs[k][-1][-1].argmax())]) for k in seqs]
        for (k, token), logits in zip(batch, runner.step(batch), strict=True):
            seqs[k] += token
            outputs[k].append(logits[0])
    for k, tokens in seqs.items():
        ours_logits = torch.stack(outputs[k])  # prompt rows, then one per step
        torch.testing.assert_close(ours_logits, hf_logits(hf, tokens), atol=atol, rtol=0)


def assert_mixed_batch_matches(hf, ours: nn.Module, atol: float) -> None:
    """One flat batch: a fresh prompt, the rest of a sequence whose prefix is cached, a 1-token prompt."""
    runner = PagedRunner(ours, BLOCK_SIZE)
    cached = random_prompt(12, seed=3)
    fresh, single = random_prompt(10, seed=4), random_prompt(1, seed=5)
    runner.step([("cached", cached[:7])])  # prefix written into its blocks by an earlier call
    out_fresh, out_rest, out_single = runner.step([("fresh", fresh), ("cached", cached[7:]), ("single", single)])
    torch.testing.assert_close(out_fresh, hf_logits(hf, fresh), atol=atol, rtol=0)
    torch.testing.assert_close(out_rest, hf_logits(hf, cached)[7:], atol=atol, rtol=0)
    torch.testing.assert_close(out_single, hf_logits(hf, single), atol=atol, rtol=0)


def assert_bf16_close(hf, ours_bf16: nn.Module, prompt: list[int]) -> None:
    """bf16 logits stay within 3% of the fp32 logit range of HF bf16, and our bf16 error against
    fp32 is no more than twice HF's own bf16 error (plus 0.5% of the range). `hf` is left as it was."""
    (logits,) = PagedRunner(ours_bf16, BLOCK_SIZE).step([("s", prompt)])
    ref32 = hf_logits(hf, prompt)
    ref16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), prompt)  # a bf16 round trip would round `hf`
    scale = ref32.abs().max()
    assert (logits - ref16).abs().max() <= 0.03 * scale
    assert (logits - ref32).abs().max() <= 2 * (ref16 - ref32).abs().max() + 0.005 * scale
