"""End-to-end numerics: greedy generation through `LLM` equals transformers' `generate`
on identical random weights (fp32, token for token), and prompt logprobs and the final
position's top logprobs agree (fp32: atol 1e-4; bf16: atol 0.1 nats against transformers run
in bf16). Families: the dense Llama family and the MoE ones (DeepSeek-V3/V2 with MLA,
Qwen3-MoE, Mixtral)."""

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


def _hf_prompt_logprobs(hf, prompt, dtype):
    model = copy.deepcopy(hf).to(dtype)  # a round trip through bf16 would round the shared fp32 weights
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_prompt_logprobs_match_transformers(checkpoint, dtype, atol):
    _, path, hf = checkpoint
    prompt = _prompts()[2]
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
    got = [ours[i][prompt[i]] for i in range(1, len(prompt))]
    want = _hf_prompt_logprobs(hf, prompt, getattr(torch, dtype))
    assert max(abs(a - b) for a, b in zip(got, want)) < atol
    assert all(len(ours[i]) <= 3 for i in range(1, len(prompt)))  # the token plus its top 2


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
