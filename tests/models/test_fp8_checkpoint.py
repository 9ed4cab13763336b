"""Block-scaled FP8 checkpoints (DeepSeek-V3's release format, also Qwen3-MoE's FP8 releases) load
and compute what they mean.

A tiny DeepSeek-V3 (and Qwen3-MoE) is quantized the way the release is: every projection in the layers (not the
router, embeddings or head) becomes e4m3 values with one fp32 factor per block. The reference is
the HF model holding the dequantized weights, which is exactly the model such a checkpoint
describes. The engine keeps the routed experts in FP8 and dequantizes the rest at load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from deepinfer_core.models.loader import load_model
from deepinfer_kernels.fp8 import FP8_DTYPE
from tests.helpers.hf_models import hf_logits, model_config_for, quantize_checkpoint_fp8, save_hf_checkpoint
from tests.helpers.paged import PagedRunner

BLOCK = (16, 16)  # the release uses [128, 128]; 16 gives the tiny model several blocks, some partial


HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(HF_CLASSES))
def fp8_checkpoint(request, tmp_path_factory):
    """(HF model loaded from the dequantized weights, FP8 checkpoint directory, dequantized directory)."""
    family = request.param
    path = tmp_path_factory.mktemp(f"{family}_fp8")
    reference = tmp_path_factory.mktemp(f"{family}_dequantized")
    save_hf_checkpoint(family, path, seed=11, moe_intermediate_size=40)  # 40: a partial block
    quantize_checkpoint_fp8(path, reference, BLOCK)
    hf_class = getattr(transformers, HF_CLASSES[family])
    hf = hf_class.from_pretrained(reference, torch_dtype=torch.float32).eval()
    return hf, path, reference


def _moe_layer(model):
    """The first layer whose feed-forward is a mixture of experts."""
    layers = model.model.layers
    return next(layer.mlp for layer in layers if hasattr(layer.mlp, "experts"))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_routed_experts_stay_fp8_and_the_rest_is_dequantized(fp8_checkpoint) -> None:
    _, path, reference = fp8_checkpoint
    model = load_model(model_config_for(path), "cpu")
    experts = _moe_layer(model).experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
    hidden = experts.w13_weight.shape[-1]
    assert experts.w13_weight_scale_inv.shape == (experts.num_experts, 2 * 3, -(-hidden // 16))  # ceil(40 / 16) = 3
    dense = dict(model.named_parameters())["model.layers.1.self_attn.o_proj.weight"]
    assert dense.dtype == torch.float32
    torch.testing.assert_close(
        dense, load_file(reference / "model.safetensors")["model.layers.1.self_attn.o_proj.weight"]
    )


def test_fp8_checkpoint_logits_match_hf_on_its_dequantized_weights(fp8_checkpoint) -> None:
    hf, path, _ = fp8_checkpoint
    model = load_model(model_config_for(path), "cpu")
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    tokens = _prompt(19, 1)
    (prefill,) = runner.step([("s", tokens)])
    torch.testing.assert_close(prefill, hf_logits(hf, tokens), atol=1e-4, rtol=0)
    for _ in range(3):
        tokens = tokens + [int(prefill[-1].argmax())]
        (prefill,) = runner.step([("s", tokens[-1:])])
        torch.testing.assert_close(prefill[0], hf_logits(hf, tokens)[-1], atol=1e-4, rtol=0)


def test_bf16_engine_from_fp8_checkpoint_equals_it_on_the_dequantized_checkpoint(fp8_checkpoint) -> None:
    """In bf16 every weight is its exact dequantization rounded once to bf16, whether the loader
    dequantized it (dense projections) or the experts do per call: the same model, bit for bit, as
    the bf16 engine on the dequantized checkpoint."""
    _, path, reference = fp8_checkpoint
    tokens = _prompt(23, 2)
    logits = []
    for directory in (path, reference):
        model = load_model(model_config_for(directory, dtype=torch.bfloat16), "cpu")
        (out,) = PagedRunner(model, block_size=4, num_blocks=64).step([("s", tokens)])
        logits.append(out)
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_fp8_weight_without_its_factors_is_named(fp8_checkpoint, tmp_path: Path) -> None:
    _, path, _ = fp8_checkpoint
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"without their weight_scale_inv: model\.layers\.0\.self_attn\.o_proj\.weight"
    ):
        load_model(model_config_for(tmp_path), "cpu")


def test_dummy_weights_with_fp8_experts_run(fp8_checkpoint) -> None:
    """`load_format="dummy"` draws FP8 experts too (benchmarks at the release's shapes need no files)."""
    _, path, _ = fp8_checkpoint
    cfg = model_config_for(path)
    model = load_model(dataclasses.replace(cfg, load_format="dummy"), "cpu")
    experts = _moe_layer(model).experts
    assert experts.w13_weight.dtype == FP8_DTYPE and experts.w13_weight.float().std() > 0
    (logits,) = PagedRunner(model, block_size=4, num_blocks=16).step([("s", _prompt(5, 3))])
    assert torch.isfinite(logits).all()
