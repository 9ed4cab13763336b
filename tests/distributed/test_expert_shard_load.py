"""An expert-parallel rank loads its shard only: from a checkpoint it builds just its slots'
experts (no tensor stacking every expert is ever allocated) and reads just its experts' tensors
(other ranks' are skipped unread), and what it holds equals the whole model's slices. With
redundant slots an expert held twice is read once and lands in both slots. Dummy weights are
drawn for its experts alone, and equal those of one process holding every expert."""

import dataclasses
import json

import pytest
import torch
from torch.overrides import TorchFunctionMode

from deepinfer_core.config import ModelConfig
from deepinfer_core.distributed.placement import ExpertPlacement
from deepinfer_core.models import loader
from deepinfer_core.models.layers.moe import FusedExperts
from tests.helpers.hf_models import save_hf_checkpoint

EXPERT_NAME = r".mlp.experts."
_ITER_TENSORS = loader.iter_tensors


class _Allocations(TorchFunctionMode):
    """Shapes of every tensor `torch.empty` makes (parameters are built from it)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.empty and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(request.param, path, seed=5, rope_scaling=None)
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig(str(path), hf_config, torch.float32, max_model_len=64)
    return config, *_load(config, None)[:2]  # and every expert: the reference


def _load(config: ModelConfig, slots):
    """The model, the checkpoint names read and the shapes allocated while loading it."""
    read: list[str] = []

    def counting(shards):
        for name, tensor in _ITER_TENSORS(shards):
            read.append(name)
            yield name, tensor

    loader.iter_tensors = counting
    try:
        with _Allocations() as allocations:
            model = loader.load_model(config, "cpu", expert_slots=slots)
    finally:
        loader.iter_tensors = _ITER_TENSORS
    return model, read, allocations.shapes


def _experts(model) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


@pytest.mark.parametrize("ranks, redundant, rank", [(2, 0, 1), (4, 4, 3)])
def test_a_rank_builds_and_reads_only_its_experts(checkpoint, ranks, redundant, rank):
    config, whole, read_whole = checkpoint
    num_experts = _experts(whole)[0].num_experts
    slots = ExpertPlacement.initial_slots(num_experts, ranks, redundant, rank)
    model, read, shapes = _load(config, slots)

    layers = _experts(model)
    full = _experts(whole)
    w13_full, w2_full = tuple(full[0].w13_weight.shape), tuple(full[0].w2_weight.shape)
    assert w13_full not in shapes and w2_full not in shapes  # never a tensor of every expert
    assert all(tuple(m.w13_weight.shape) == (len(slots), *w13_full[1:]) for m in layers)

    expert_reads = [n for n in read if EXPERT_NAME in n]
    held = sorted(set(slots))
    assert len(expert_reads) == len(layers) * len(held) * 3  # gate, up, down of each held expert, once
    assert {int(n.split(EXPERT_NAME)[1].split(".")[0]) for n in expert_reads} == set(held)
    assert len([n for n in read_whole if EXPERT_NAME in n]) == len(layers) * num_experts * 3
    assert [n for n in read if EXPERT_NAME not in n] == [n for n in read_whole if EXPERT_NAME not in n]

    for mine, ref in zip(layers, full):
        assert mine.local_experts == slots
        index = torch.tensor(slots)
        assert torch.equal(mine.w13_weight, ref.w13_weight[index]) and torch.equal(mine.w2_weight, ref.w2_weight[index])


def test_a_rank_draws_dummy_weights_for_its_experts_alone(checkpoint):
    config = dataclasses.replace(checkpoint[0], load_format="dummy")
    whole = loader.load_model(config, "cpu")
    slots = ExpertPlacement.initial_slots(_experts(whole)[0].num_experts, 4, 4, 2)
    model, read, shapes = _load(config, slots)
    assert read == []  # no weight file is opened
    assert tuple(_experts(whole)[0].w13_weight.shape) not in shapes
    index = torch.tensor(slots)
    for mine, ref in zip(_experts(model), _experts(whole)):
        assert torch.equal(mine.w13_weight, ref.w13_weight[index]) and torch.equal(mine.w2_weight, ref.w2_weight[index])
    stacked = {n for n, _ in model.named_parameters() if ".experts.w" in n}
    reference = dict(whole.named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters() if n not in stacked)
