"""Offline throughput of `LLM.generate` vs transformers' `generate` on the same random weights.

Prints a table and the ratio (ours / transformers), measured side by side in one run.

    python benchmarks/offline_throughput.py [--device cpu|cuda] [--prompts 16] [--prompt-len 64] [--new 64]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch
import transformers

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR

SHAPES = {
    # name: config overrides for a random Llama-architecture model
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
    ),
    "medium": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
    ),
}


def build_checkpoint(shape: str, path: str) -> None:
    config = transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **SHAPES[shape])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", f"{path}/{name}")


def run_hf(path: str, prompts: list[list[int]], new: int, device: str, dtype: torch.dtype) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm up
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync(device)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new
    del model
    return elapsed


def run_ours(path: str, prompts: list[list[int]], new: int, device: str, dtype: torch.dtype) -> float:
    llm = LLM(
        path,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=2048,
        enable_prefix_caching=False,
        num_gpu_blocks=4096 if device == "cpu" else None,
        gpu_memory_utilization=0.5,
        max_num_seqs=max(len(prompts), 1),
    )
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=2))  # warm up
    _sync(device)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync(device)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return elapsed


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["small"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device != "cpu" else torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (args.prompts, args.prompt_len), generator=g).tolist()
    gen_tokens = args.prompts * args.new
    print(f"device={args.device} dtype={dtype} prompts={args.prompts}x{args.prompt_len} new_tokens={args.new}")
    print(f"{'shape':<8} {'engine':<14} {'seconds':>9} {'out tok/s':>10} {'ratio':>7}")
    for shape in args.shape:
        with tempfile.TemporaryDirectory() as path:
            build_checkpoint(shape, path)
            hf = run_hf(path, prompts, args.new, args.device, dtype)
            ours = run_ours(path, prompts, args.new, args.device, dtype)
        print(f"{shape:<8} {'transformers':<14} {hf:>9.2f} {gen_tokens / hf:>10.1f} {1.0:>7.2f}")
        print(f"{shape:<8} {'deepinfer':<14} {ours:>9.2f} {gen_tokens / ours:>10.1f} {hf / ours:>7.2f}")


if __name__ == "__main__":
    main()
