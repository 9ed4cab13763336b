"""Configs and checkpoints of the MoE and vision families: registry, loading, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.llava import LlavaForConditionalGeneration
from deepinfer_core.models.loader import load_model
from deepinfer_core.models.qwen3_moe import Qwen3MoeForCausalLM
from deepinfer_core.models.registry import get_model_class, get_vision_encoder_class
from tests.helpers.hf_models import model_config_for, save_hf_checkpoint, save_hf_llava, tiny_hf_config


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("deepseek")
    save_hf_checkpoint("deepseek_v3", directory)
    return directory


@pytest.fixture
def ckpt(deepseek: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(deepseek, tmp_path / "ckpt"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_registry_resolves_the_new_families() -> None:
    for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        assert get_model_class({"architectures": [arch]}) is DeepseekV3ForCausalLM
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert get_model_class({"architectures": [arch]}) is Qwen3MoeForCausalLM
    assert get_model_class({"model_type": "deepseek_v3"}) is DeepseekV3ForCausalLM
    assert get_model_class({"model_type": "llava"}) is LlavaForConditionalGeneration
    with pytest.raises(ValueError, match="has no vision encoder"):
        get_vision_encoder_class({"architectures": ["DeepseekV3ForCausalLM"]})


def test_unsupported_model_type_is_named(ckpt: Path) -> None:
    _edit_config(ckpt, architectures=None, model_type="deepseek_v9")
    with pytest.raises(ValueError, match="deepseek_v9"):
        load_model(model_config_for(ckpt), "cpu")


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "factor": 2.0}, {"type": "ntk-by-parts", "factor": 2.0}])
def test_unknown_rope_scaling_is_named(ckpt: Path, rope: dict) -> None:
    _edit_config(ckpt, rope_parameters=None, rope_scaling=rope)
    name = rope.get("rope_type") or rope["type"]
    with pytest.raises(ValueError, match=f"unsupported rope type '{name}'"):
        load_model(model_config_for(ckpt), "cpu")


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
        ({"quant_method": "fp8"}, "weight_block_size"),  # per-tensor FP8: no block factors
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
        ({"quant_method": "fp8", "weight_block_size": [128, 96]}, "powers of two"),
    ],
)
def test_quantizations_that_do_not_load_are_refused(ckpt: Path, quant: dict, message: str) -> None:
    _edit_config(ckpt, quantization_config=quant)
    with pytest.raises(ValueError, match=message):
        load_model(model_config_for(ckpt), "cpu")


def test_missing_expert_tensor_is_named(ckpt: Path) -> None:
    _edit_weights(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(model_config_for(ckpt), "cpu")


def test_missing_score_correction_bias_is_named(ckpt: Path) -> None:
    _edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate\.e_score_correction_bias"):
        load_model(model_config_for(ckpt), "cpu")


def test_unexpected_and_misshapen_expert_tensors_are_named(ckpt: Path, tmp_path: Path) -> None:
    other = Path(shutil.copytree(ckpt, tmp_path / "other"))
    _edit_weights(ckpt, lambda t: t.update({"model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight"):
        load_model(model_config_for(ckpt), "cpu")
    _edit_weights(other, lambda t: t.update({"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(8, 8)}))
    with pytest.raises(ValueError, match="expert 0 down_proj has shape"):
        load_model(model_config_for(other), "cpu")


def test_multi_token_prediction_layers_are_skipped(ckpt: Path) -> None:
    """DeepSeek-V3 releases carry an MTP layer after the last decoder layer; decoding ignores it."""

    def add_mtp(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)

    _edit_weights(ckpt, add_mtp)
    model = load_model(model_config_for(ckpt), "cpu")
    assert len(model.model.layers) == 3


def test_moe_weights_load_in_bf16_with_an_fp32_router(deepseek: Path) -> None:
    model = load_model(model_config_for(deepseek, dtype=torch.bfloat16), "cpu")
    moe = model.model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == torch.bfloat16 and moe.experts.w13_weight.shape == (8, 64, 64)
    assert moe.gate.weight.dtype == torch.float32  # routing decisions in fp32, as the reference does
    assert moe.gate.e_score_correction_bias.dtype == torch.float32


def test_llava_config_lifts_text_settings() -> None:
    config = {
        "model_type": "llava",
        "text_config": tiny_hf_config("deepseek_v3", eos_token_id=7).to_dict(),
        "vision_config": {"model_type": "clip_vision_model"},
    }
    normalized = normalize_hf_config(config)
    assert normalized["vocab_size"] == 256 and normalized["max_position_embeddings"] == 512
    assert normalized["eos_token_id"] == 7
    assert normalized["text_config"]["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(vision_config={"model_type": "vit_mae"}), "unsupported vision tower model_type 'vit_mae'"),
        (dict(vision_feature_select_strategy="pooled"), "vision_feature_select_strategy 'pooled'"),
        (dict(vision_feature_layer=-9), "outside the tower's 3 layers"),
        (dict(projector_hidden_act="swish7"), "unsupported activation 'swish7'"),
    ],
)
def test_bad_llava_configs_are_named(tmp_path: Path, changes: dict, message: str) -> None:
    save_hf_llava(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(model_config_for(tmp_path), "cpu")


def test_llava_checkpoint_in_the_newer_layout_loads(tmp_path: Path) -> None:
    """transformers also writes `model.language_model.*`, `model.vision_tower.*`, `lm_head.weight`."""
    hf = save_hf_llava(tmp_path / "old", text_family="qwen3_moe", seed=3)
    tensors = load_file(tmp_path / "old" / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if name == "language_model.lm_head.weight":
            renamed["lm_head.weight"] = t
        elif name.startswith("language_model.model."):
            renamed["model.language_model." + name[len("language_model.model.") :]] = t
        else:
            renamed["model." + name.replace("vision_tower.", "vision_tower.vision_model.")] = t
    (tmp_path / "new").mkdir()
    shutil.copy(tmp_path / "old" / "config.json", tmp_path / "new" / "config.json")
    save_file(renamed, tmp_path / "new" / "model.safetensors", metadata={"format": "pt"})
    old = load_model(model_config_for(tmp_path / "old"), "cpu").state_dict()
    new = load_model(model_config_for(tmp_path / "new"), "cpu").state_dict()
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert hf.config.text_config.model_type == "qwen3_moe"
