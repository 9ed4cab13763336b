"""Tiny random HF transformers models, saved as real checkpoints, for numerics and loader tests.

HF's own init leaves norms at one and biases at zero, which would let a model that forgot a
norm weight or a bias still match. `build_hf_model` redraws every parameter from a seeded
generator instead, so each one matters for the logits.

    hf = save_hf_checkpoint("qwen3", tmp_path / "ckpt")        # random tiny Qwen3, safetensors
    ref = hf_logits(hf, token_ids)                            # [len, vocab] fp32 reference
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.hf_config import load_hf_config
from deepinfer_kernels.fp8 import dequantize_block_fp8, quantize_block_fp8

# family -> (config class, model class) names in transformers
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# MLA + DeepSeekMoE at toy sizes: 3 layers (1 dense), 8 routed experts in 4 groups, 1 shared
TINY_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    num_hidden_layers=3,
)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": TINY_MLA,
    # V2-Lite style: no q_lora_rank, softmax routing limited to the best groups by max score
    "deepseek_v2": dict(TINY_MLA, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    "qwen3_moe": dict(
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}
# YaRN as DeepSeek-V3 configures it (mscale == mscale_all_dim: attention factor 1, softmax scale grows)
DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)
# rope scaling for a tiny model: the llama3 bands fall inside head_dim=16's wavelengths
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def tiny_hf_config(family: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A small config of `family` (a key of FAMILIES); overrides win."""
    config_cls = getattr(transformers, FAMILIES[family][0])
    kwargs = {**TINY, **FAMILY_DEFAULTS.get(family, {}), **overrides}
    if family == "mistral":
        kwargs.setdefault("sliding_window", None)
    return config_cls(**kwargs)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Redraw every parameter: normal(0, std) matrices, 1 + noise norms, noise biases (MoE routers'
    score-correction biases too, which HF keeps as buffers)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for name, param in tensors:
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("bias"):
                param.copy_(std * noise)
            elif param.dim() == 1:
                param.copy_(1.0 + std * noise)
            else:
                param.copy_(std * noise)


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random tiny HF model of `family` in fp32, eval mode."""
    config = tiny_hf_config(family, **overrides)
    model = getattr(transformers, FAMILIES[family][1])(config)
    randomize_(model, seed)
    return model.eval()


def save_hf_checkpoint(
    family: str,
    directory: str | os.PathLike,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Build a random tiny model and `save_pretrained` it as safetensors (sharded when
    `max_shard_size` is given, e.g. "100KB"); returns the HF model."""
    model = build_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32,
                   patch_size=8)  # fmt: skip
VISION_CONFIGS = {"clip": "CLIPVisionConfig", "siglip": "SiglipVisionConfig"}
IMAGE_TOKEN_ID = 250  # inside TINY's 256-token vocabulary


def build_hf_llava(
    text_family: str = "llama", vision: str = "clip", seed: int = 0, text: dict | None = None, **overrides: Any
) -> transformers.PreTrainedModel:
    """A random tiny LLaVA (tower of `vision`: "clip" or "siglip", language model of `text_family`)."""
    vision_config = getattr(transformers, VISION_CONFIGS[vision])(**TINY_VISION)
    kwargs = dict(image_token_index=IMAGE_TOKEN_ID, image_seq_length=16)
    if vision == "siglip":
        kwargs.update(vision_feature_select_strategy="full", vision_feature_layer=-1)
    config = transformers.LlavaConfig(
        vision_config=vision_config, text_config=tiny_hf_config(text_family, **(text or {})), **{**kwargs, **overrides}
    )
    model = transformers.LlavaForConditionalGeneration(config)
    randomize_(model, seed)
    return model.eval()


HF_IMAGE_PROCESSORS = {
    "clip": lambda: transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ),
    "siglip": lambda: transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32}),
}
"""The image processor of each tower at TINY_VISION's size, pinned to transformers' PIL backend
(which ours follows step for step; tests/models/test_llava.py says why)."""


def save_hf_llava(directory: str | os.PathLike, **kwargs: Any) -> transformers.PreTrainedModel:
    """`build_hf_llava(**kwargs)` saved with `save_pretrained`; returns the HF model."""
    model = build_hf_llava(**kwargs)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def model_config_for(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32, max_model_len: int = 256
) -> ModelConfig:
    """The engine's ModelConfig for a saved checkpoint directory."""
    path = str(directory)
    return ModelConfig(path=path, hf_config=load_hf_config(path), dtype=dtype, max_model_len=max_model_len)


def hf_logits(model: transformers.PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """HF logits [len, vocab] (fp32) for every position of one sequence."""
    with torch.inference_mode():
        out = model(torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float()


def quantize_checkpoint_fp8(path: str | os.PathLike, reference: str | os.PathLike, block: tuple[int, int]) -> None:
    """Turn the checkpoint in `path` into a block-FP8 one, as DeepSeek-V3's release is made: every
    projection in the layers (not the router, embeddings or head) becomes e4m3 values plus
    `weight_scale_inv` factors, and `quantization_config` says so. `reference` receives the
    dequantized weights under the original config: the unquantized model the FP8 one means."""
    path, reference = Path(path), Path(reference)
    tensors = load_file(path / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if (
            name.startswith("model.layers.")
            and name.endswith(".weight")
            and tensor.dim() == 2
            and not name.endswith("mlp.gate.weight")
        ):
            q, scale = quantize_block_fp8(tensor, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, block)
        else:
            fp8[name] = dequantized[name] = tensor
    (reference / "config.json").write_bytes((path / "config.json").read_bytes())
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


def save_hf_deepseek_mtp(directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random tiny DeepSeek-V3 checkpoint with one MTP layer, as the V3 release lays it out.

    transformers has no MTP module: a model with one layer more is saved with `save_pretrained`,
    its last layer becomes the MTP layer's block (`model.layers.<N>.*`), `config.json` says
    `num_hidden_layers = N, num_nextn_predict_layers = 1`, and the MTP-only tensors (`enorm`,
    `hnorm`, `eh_proj`, `shared_head.{norm,head}`, `embed_tokens`) are added, drawn from `seed`.
    Returns the HF model of N + 1 layers (its layer N is the reference for the MTP block)."""
    n = overrides.pop("num_hidden_layers", TINY_MLA["num_hidden_layers"])
    model = build_hf_model("deepseek_v3", seed, num_hidden_layers=n + 1, **overrides)
    model.config._attn_implementation = "eager"
    model.save_pretrained(directory, safe_serialization=True)
    path = Path(directory)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    h = model.config.hidden_size
    extra = {"enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen), "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
             "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen),
             "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
             "shared_head.head.weight": tensors["lm_head.weight"].clone(),
             "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}  # fmt: skip
    tensors.update({f"model.layers.{n}.{k}": t.contiguous() for k, t in extra.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    model.mtp_extra = {k: t for k, t in extra.items()}
    return model
