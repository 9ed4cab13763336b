"""Config loading, the architecture registry and weight loading: happy paths and every error."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.config import ModelConfig
from deepinfer_core.models.hf_config import load_hf_config, normalize_hf_config
from deepinfer_core.models.llama import LlamaForCausalLM
from deepinfer_core.models.loader import load_model
from deepinfer_core.models.registry import get_model_class, supported_architectures
from tests.helpers.hf_models import model_config_for, save_hf_checkpoint
from tests.helpers.paged import PagedRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A pristine tiny Llama checkpoint; tests copy it before damaging it."""
    directory = tmp_path_factory.mktemp("llama")
    save_hf_checkpoint("llama", directory)
    return directory


@pytest.fixture
def ckpt(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def _builtin_config(seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelConfig:
    hf_config = load_hf_config(TINY_MODEL_DIR)
    return ModelConfig(TINY_MODEL_DIR, hf_config, dtype, max_model_len=512, seed=seed, builtin=True)


def _resave(directory: Path, edit) -> None:
    """Rewrite model.safetensors with `edit(tensors)` applied."""
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


# --- config.json ------------------------------------------------------------------------------


def test_missing_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_config(str(missing))
    config = dataclasses.replace(_builtin_config(), path=str(missing), builtin=False)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(config, "cpu")


def test_missing_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path))


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(str(tmp_path))


def test_config_is_normalised() -> None:
    legacy = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "rope_theta": 500.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = normalize_hf_config(legacy)
    assert cfg["head_dim"] == 16 and cfg["num_key_value_heads"] == 4
    assert cfg["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    assert cfg["rope_scaling"]["factor"] == 2.0 and cfg["rope_theta"] == 500.0
    assert normalize_hf_config(cfg) == cfg
    assert "head_dim" not in legacy  # the input is not modified
    assert normalize_hf_config({**legacy, "rope_scaling": None})["rope_scaling"] is None


# --- registry ---------------------------------------------------------------------------------


def test_registry_resolves_every_family() -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class({"architectures": [arch]}) is LlamaForCausalLM
    assert get_model_class({"model_type": "qwen3"}) is LlamaForCausalLM


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert all(arch in str(err.value) for arch in supported_architectures())
    with pytest.raises(ValueError, match="bert"):
        get_model_class({"model_type": "bert"})


# --- safetensors ------------------------------------------------------------------------------


def test_loads_checkpoint_in_eval_mode_and_dtype(ckpt: Path) -> None:
    model = load_model(model_config_for(ckpt, dtype=torch.bfloat16), "cpu")
    assert not model.training
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32
    assert model.kv_cache_block_shape(16) == (2, 16, 2, 16) and model.num_kv_cache_layers == 2


def test_no_weight_files_names_the_directory(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=str(ckpt)):
        load_model(model_config_for(ckpt), "cpu")


def test_truncated_file_is_named(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(model_config_for(ckpt), "cpu")


def test_missing_tensor_is_listed(ckpt: Path) -> None:
    _resave(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_config_for(ckpt), "cpu")


def test_unexpected_tensor_is_listed(ckpt: Path) -> None:
    _resave(ckpt, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"does not use.*model\.layers\.0\.mystery\.weight"):
        load_model(model_config_for(ckpt), "cpu")


def test_rotary_buffers_in_checkpoint_are_ignored(ckpt: Path) -> None:
    _resave(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(model_config_for(ckpt), "cpu")


def test_wrong_shape_is_named(ckpt: Path) -> None:
    _resave(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(3,\)"):
        load_model(model_config_for(ckpt), "cpu")


def test_sharded_index_with_missing_shard(tmp_path: Path) -> None:
    save_hf_checkpoint("llama", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(model_config_for(tmp_path), "cpu")


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path: Path) -> None:
    save_hf_checkpoint("mistral", tmp_path, sliding_window=64)
    with pytest.raises(ValueError, match="sliding"):
        load_model(model_config_for(tmp_path, max_model_len=128), "cpu")
    load_model(model_config_for(tmp_path, max_model_len=64), "cpu")


def test_max_model_len_beyond_scaled_rope_is_refused(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert load_model(model_config_for(ckpt, max_model_len=1024), "cpu").max_positions == 1024
    with pytest.raises(ValueError, match="max_model_len=1025"):
        load_model(model_config_for(ckpt, max_model_len=1025), "cpu")


# --- built-in weights -------------------------------------------------------------------------


def test_builtin_weights_are_deterministic() -> None:
    first = load_model(_builtin_config(seed=0), "cpu").state_dict()
    second = load_model(_builtin_config(seed=0), "cpu").state_dict()
    other = load_model(_builtin_config(seed=1), "cpu").state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    emb = "language_model.model.embed_tokens.weight"
    assert not torch.equal(first[emb], other[emb])
    assert torch.equal(first["language_model.model.norm.weight"], torch.ones(128))
    assert first[emb].std().item() == pytest.approx(0.08, rel=0.05)  # the config's initializer_range


def test_builtin_model_runs() -> None:
    model = load_model(_builtin_config(dtype=torch.bfloat16), "cpu")
    (logits,) = PagedRunner(model, block_size=16).step([("s", [1, 2, 3, 4, 5])])
    assert logits.shape == (5, 1024) and torch.isfinite(logits).all()
