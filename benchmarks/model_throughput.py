"""Per model family: output tokens/s of `LLM.generate` vs transformers' `generate`, same random weights.

Families: a dense Llama, DeepSeek-V3 (MLA + DeepSeekMoE), Qwen3-MoE, Mixtral, and a LLaVA
(CLIP tower + DeepSeek-V3 language model, the built-in model's composition) with one image per
prompt. Each row is measured side by side in one run; ratio = ours / transformers.

    python benchmarks/model_throughput.py [--device cpu|cuda] [--family deepseek_v3 ...] [--prompts 8]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from PIL import Image

if __package__ in (None, ""):  # run as a script: its sibling modules import as `benchmarks.X` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.offline_throughput import _sync  # noqa: E402
from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.builtin import TINY_MODEL_DIR  # noqa: E402

VOCAB = 1024
IMAGE_TOKEN = 1022  # the shipped tokenizer's <|image|>
DENSE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
MLA = dict(num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32, moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=1,
           num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1)  # fmt: skip
FAMILIES = {
    # name: (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", DENSE),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DENSE, **MLA}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**DENSE, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**DENSE, "num_local_experts": 8, "num_experts_per_tok": 2}),
}  # fmt: skip
VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, image_size=64,
              patch_size=8)  # 64 image tokens  # fmt: skip


def build(family: str, path: str) -> transformers.PreTrainedModel:
    """A randomly initialised HF model of `family`, saved (with the shipped tokenizer) to `path`."""
    torch.manual_seed(0)
    if family == "llava":
        cfg_cls, _, overrides = FAMILIES["deepseek_v3"]
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**VISION),
            text_config=getattr(transformers, cfg_cls)(**overrides),
            image_token_index=IMAGE_TOKEN,
        )
        model = transformers.LlavaForConditionalGeneration(config)
        transformers.CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size=64).save_pretrained(path)
    else:
        cfg_cls, model_cls, overrides = FAMILIES[family]
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**overrides))
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", f"{path}/{name}")
    return model.eval()


def image(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (72, 80, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def run_hf(model, prompts, images, new: int, device: str, dtype: torch.dtype) -> float:
    model = model.to(device=device, dtype=dtype)
    model.generation_config.eos_token_id = None
    kwargs = {}
    if images:
        processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size=64)
        pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]
        kwargs["pixel_values"] = pixels.to(device=device, dtype=dtype)
        image_tokens = (VISION["image_size"] // VISION["patch_size"]) ** 2
        prompts = [[IMAGE_TOKEN] * image_tokens + p for p in prompts]
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    with torch.inference_mode():
        warm = {k: v[:1] for k, v in kwargs.items()}
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0, **warm)
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new
    return elapsed


def run_ours(path: str, prompts, images, new: int, device: str, dtype: torch.dtype) -> float:
    llm = LLM(path, device=device, dtype=str(dtype).removeprefix("torch."), max_model_len=1024,
              enable_prefix_caching=False, num_gpu_blocks=2048 if device == "cpu" else None)  # fmt: skip
    requests = [{"prompt_token_ids": p} for p in prompts]
    if images:
        requests = [{"prompt_token_ids": [IMAGE_TOKEN] + p, "multi_modal_data": {"image": b}} for p, b in
                    zip(prompts, images)]  # fmt: skip
    llm.generate(requests[:1], SamplingParams(temperature=0, max_tokens=2))  # warm up
    _sync(device)
    t = time.perf_counter()
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    _sync(device)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--family", choices=[*FAMILIES, "llava"], nargs="+", default=[*FAMILIES, "llava"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device != "cpu" else torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (args.prompts, args.prompt_len), generator=g).tolist()
    gen_tokens = args.prompts * args.new
    print(f"device={args.device} dtype={dtype} prompts={args.prompts}x{args.prompt_len} new_tokens={args.new}")
    print(f"{'family':<12} {'engine':<14} {'seconds':>9} {'out tok/s':>10} {'ratio':>7}")
    for family in args.family:
        images = [image(i) for i in range(args.prompts)] if family == "llava" else None
        with tempfile.TemporaryDirectory() as path:
            model = build(family, path)
            hf = run_hf(model, prompts, images, args.new, args.device, dtype)
            del model
            ours = run_ours(path, prompts, images, args.new, args.device, dtype)
        print(f"{family:<12} {'transformers':<14} {hf:>9.2f} {gen_tokens / hf:>10.1f} {1.0:>7.2f}")
        print(f"{family:<12} {'deepinfer':<14} {ours:>9.2f} {gen_tokens / ours:>10.1f} {hf / ours:>7.2f}")


if __name__ == "__main__":
    main()
