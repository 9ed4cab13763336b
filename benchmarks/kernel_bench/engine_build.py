"""The engine under test: a random-weight model directory, the engine built from it, prompts,
and running prompts to completion."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from benchmarks.kernel_bench.engine_spec import SEED, Spec


def write_model_dir(path: str, hf_config: dict[str, Any]) -> None:
    """config.json of the random model plus the shipped tokenizer (prompts are token ids; the
    tokenizer is only what the engine loads)."""
    from deepinfer_core.builtin import TINY_MODEL_DIR

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(hf_config, torch_dtype="bfloat16"), f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY_MODEL_DIR, name), os.path.join(path, name))


def num_kv_blocks(spec: Spec, block_size: int = 16) -> int:
    """KV blocks for the largest phase (the decode batch), each sequence's whole generation reserved."""

    def blocks(tokens: int) -> int:
        return (tokens + block_size - 1) // block_size + 1

    decode = spec.batch * blocks(spec.context + spec.decode_max_tokens + 1)
    return max(decode, blocks(spec.prefill_tokens + 2), 2 * blocks(spec.context + 8)) + spec.batch + 16


def build_engine(path: str, spec: Spec):
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine_args import EngineArgs

    args = EngineArgs(
        model=path,
        load_format="dummy",
        device=spec.device,
        dtype="bfloat16" if spec.cuda else "float32",
        seed=SEED,
        max_model_len=spec.max_model_len,
        num_gpu_blocks=num_kv_blocks(spec),
        max_num_seqs=spec.batch,
        max_num_batched_tokens=max(spec.max_model_len, 16384 if spec.cuda else 0),
        enable_prefix_caching=False,
    )
    return LLMEngine.from_engine_args(args)


def greedy_params(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored, no detokenizing)."""
    from deepinfer_core.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def generate_all(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    """Run the prompts to completion (the engine's `LLM.generate` loop); the output token ids."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, params=greedy_params(max_tokens))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[rid] for rid in ids]
