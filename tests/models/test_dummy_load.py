"""`load_format="dummy"`: random weights drawn on the device from a seed, no weight file read."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.models.loader import load_model
from tests.helpers.hf_models import model_config_for, tiny_hf_config


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    """A Qwen3-MoE model directory with config.json and the shipped tokenizer, and no weights."""
    tiny_hf_config("qwen3_moe", attention_bias=True).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(TINY_MODEL_DIR) / name, tmp_path / name)
    assert not list(tmp_path.glob("*.safetensors"))
    return tmp_path


def _load(directory: Path, seed: int = 0, load_format: str = "dummy") -> torch.nn.Module:
    config = dataclasses.replace(model_config_for(directory), seed=seed, load_format=load_format)
    return load_model(config, "cpu")


def test_dummy_weights_need_no_weight_files(config_only: Path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        _load(config_only, load_format="auto")
    params = dict(_load(config_only).named_parameters())
    experts = params["model.layers.0.mlp.experts.w13_weight"]
    assert experts.std().item() == pytest.approx(0.02, rel=0.1)
    assert params["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(params["model.norm.weight"], torch.ones_like(params["model.norm.weight"]))
    assert not params["model.layers.0.self_attn.q_proj.bias"].any()
    assert all(torch.isfinite(p).all() for p in params.values())


def test_dummy_weights_repeat_for_a_seed(config_only: Path) -> None:
    a, b, c = (dict(_load(config_only, seed).named_parameters()) for seed in (0, 0, 1))
    name = "model.layers.1.self_attn.o_proj.weight"
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a[name], c[name])


def test_unknown_load_format_is_refused(config_only: Path) -> None:
    with pytest.raises(ValueError, match="load_format"):
        dataclasses.replace(model_config_for(config_only), load_format="pt")


def test_engine_generates_with_dummy_weights(config_only: Path) -> None:
    llm = LLM(str(config_only), load_format="dummy", max_model_len=64, num_gpu_blocks=64, device="cpu")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
