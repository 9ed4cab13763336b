"""End-to-end numerics: greedy generation through `LLM` equals transformers' `generate`
on identical random weights (fp32, token for token), and prompt logprobs and the final
position's top logprobs agree (fp32: atol 1e-4; bf16: no less accurate than transformers run in
bf16, both measured against transformers in fp32). Families: the dense Llama family and the MoE
ones (DeepSeek-V3/V2 with MLA, Qwen3-MoE, Mixtral)."""

import copy
import shutil

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from tests.helpers.hf_models import save_hf_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3", "deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral"]
MAX_NEW = 10


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = [3, 17, 40, 9, 64]
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    overrides = {"rope_scaling": None}
    if family == "llama":
        overrides = {"tie_word_embeddings": True}
    hf = save_hf_checkpoint(family, path, seed=3, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
    hf.generation_config.eos_token_id = None
    return family, str(path), hf


def _hf_greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def references(checkpoint):
    _, _, hf = checkpoint
    return [_hf_greedy(hf, p) for p in _prompts()]


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(),  # one batch of mixed lengths, whole prompts
        dict(chunked_prefill=True, max_num_batched_tokens=16),  # prompts split into chunks
    ],
    ids=["whole", "chunked"],
)
def test_greedy_batch_equals_transformers(checkpoint, references, engine_kw):
    _, path, _ = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks=128, block_size=8, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _greedy())
    assert [o.outputs[0].token_ids for o in outs] == references


def test_greedy_with_prefix_cache_hits_equals_transformers(checkpoint):
    _, path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks=128, block_size=8)
    base = _prompts()[4]  # 64 tokens
    first = llm.generate([{"prompt_token_ids": base}], _greedy())[0]
    assert first.num_cached_tokens == 0
    variants = [base[:50] + [7, 8, 9], base + [11]]
    outs = llm.generate([{"prompt_token_ids": v} for v in variants], _greedy())
    assert all(o.num_cached_tokens >= 48 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, v) for v in variants]


def _hf_prompt_logprobs(hf, prompt, dtype) -> torch.Tensor:
    model = copy.deepcopy(hf).to(dtype)  # a round trip through bf16 would round the shared fp32 weights
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))])


# bf16 prompt logprobs: HF's own bf16 error (HF bf16 against HF fp32, per position) is the yardstick.
# Ours against HF fp32 may be at most BF16_FACTOR times that error at a typical position (median)
# and at the worst one, plus a floor each: half a typical bf16 error (HF's medians here are 0.004 to
# 0.015 nats), and for the worst position the former absolute limit, 0.1 nats.
# Why not "within 0.1 nats of HF bf16" at every position: MoE routers' near-ties. In this DeepSeek-V3
# checkpoint HF bf16 is 0.575 nats from fp32 at position 17, because bf16 rounding flips a last-layer
# choice whose biased scores are 5e-4 apart (experts 4 and 5: 0.6830 / 0.6835). Whether another bf16
# implementation flips it as well depends on every rounding and summation order (cuBLAS's GEMMs or the
# CPU's, the Triton kernels' epilogues), not on correctness: on an H200 ours came out 0.35 nats from
# HF bf16; the Triton paged-attention kernel alone (CPU interpreter) puts Qwen3-MoE 0.16 nats from HF
# bf16 at a position where HF bf16 and fp32 agree; the torch path on the CPU is 1.09 nats from HF
# bf16 on Mixtral's prompt 4 (0.82 from fp32, where HF bf16 is 1.10 away). Flips move single
# positions, so the median is the typical-accuracy check. Measured over every family and prompts 2
# and 4, torch path on the CPU and Triton path in the interpreter: ours at most 1.6x HF's median
# (within the floor) and 1.5x its worst. Bugs (DeepSeek-V3, prompt 2; fp32 catches them too): MLA
# softmax scale x1.1 -> median 2.5x; e_score_correction_bias ignored -> 11x; routed_scaling_factor
# dropped -> 22x.
BF16_FACTOR = 1.5
BF16_FLOOR_MEDIAN, BF16_FLOOR_MAX = 0.005, 0.1  # nats


def _prompt_logprobs(path: str, prompt: list[int], dtype: str) -> torch.Tensor:
    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=256,
        num_gpu_blocks=64,
        block_size=8,
        chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(prompt_logprobs=2))[0]
    ours = out.prompt_logprobs
    assert len(ours) == len(prompt) and ours[0] is None
    assert all(len(ours[i]) <= 3 for i in range(1, len(prompt)))  # the token plus its top 2
    return torch.tensor([ours[i][prompt[i]] for i in range(1, len(prompt))])


def test_prompt_logprobs_match_transformers_fp32(checkpoint):
    _, path, hf = checkpoint
    prompt = _prompts()[2]
    got = _prompt_logprobs(path, prompt, "float32")
    want = _hf_prompt_logprobs(hf, prompt, torch.float32)
    assert (got - want).abs().max() < 1e-4


def test_bf16_prompt_logprobs_as_accurate_as_transformers_bf16(checkpoint):
    """bf16 prompt logprobs no further from HF fp32 than BF16_FACTOR x HF bf16's own distance, at
    a typical position and at the worst one (see BF16_FACTOR for why and for the measured numbers)."""
    _, path, hf = checkpoint
    prompt = _prompts()[2]
    got = _prompt_logprobs(path, prompt, "bfloat16")
    ref32 = _hf_prompt_logprobs(hf, prompt, torch.float32)
    ref16 = _hf_prompt_logprobs(hf, prompt, torch.bfloat16)
    ours_err, hf_err = (got - ref32).abs(), (ref16 - ref32).abs()
    report = (
        f"ours - HF fp32: median {ours_err.median():.4f}, max {ours_err.max():.4f} (position {int(ours_err.argmax())}); "
        f"HF bf16 - HF fp32: median {hf_err.median():.4f}, max {hf_err.max():.4f} (position {int(hf_err.argmax())}); "
        f"ours - HF bf16: max {(got - ref16).abs().max():.4f}"
    )
    assert ours_err.median() <= BF16_FACTOR * hf_err.median() + BF16_FLOOR_MEDIAN, report
    assert ours_err.max() <= BF16_FACTOR * hf_err.max() + BF16_FLOOR_MAX, report


def test_preemption_with_recompute_finishes_every_request_correctly(checkpoint, references):
    _, path, _ = checkpoint
    # 10 blocks of 8 tokens cannot hold five sequences of up to 74 tokens at once
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks=12, block_size=8, max_num_batched_tokens=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == references
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.scheduler.block_manager.num_free_blocks == 12


def test_final_position_logits_match_transformers(checkpoint):
    """Top-5 logprobs of the first sampled token (the last prompt position's logits), each prompt
    of a mixed-length batch, against HF's full-sequence logits: fp32, atol 1e-4."""
    _, path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks=128, block_size=8)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=5))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        top = out.outputs[0].logprobs[0]
        assert len(top) >= 5
        for token, lp in top.items():
            assert abs(lp - ref[token].item()) < 1e-4
        assert set(torch.topk(ref, 5).indices.tolist()) <= set(top)
