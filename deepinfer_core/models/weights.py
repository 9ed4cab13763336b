"""Copying checkpoint tensors into a model by name, for models whose names differ from HF's.

A model maps each checkpoint name to a *canonical* name (`rename`): its own parameter name, or,
for a routed expert, `<prefix>.experts.<e>.<gate|up|down>_proj.weight` (and, from an FP8
checkpoint, `.weight_scale_inv`), which `FusedExperts` copies into its stacked slice. `rename`
returns None for tensors the model knows but does not hold (an MTP layer, an unused vision
layer, another rank's half of a checkpoint).

`expert_filter` names the tensors an expert-parallel rank need not read: other ranks' experts.

`load_weights_by_name` returns every checkpoint name it consumed plus the canonical names it
filled; `expected_weight_names` lists the canonical names a complete load must fill, so the
loader's missing/unexpected check works whatever the checkpoint's spelling.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from deepinfer_core.models.layers.moe import EXPERT_PROJECTIONS, FusedExperts

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|weight_scale_inv)$")
_CANONICAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

Rename = Callable[[str], "str | None"]


def _expert_modules(model: nn.Module) -> dict[str, FusedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedExperts)}


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def load_weights_by_name(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename = lambda n: n
) -> set[str]:
    """Copy each tensor into the parameter (or expert slice) its canonical name names.

    Unknown names are left unconsumed, for the loader to report.
    """
    params = dict(model.named_parameters())
    experts = _expert_modules(model)
    consumed: set[str] = set()
    for name, tensor in weights:
        target = rename(name)
        if target is None:
            consumed.add(name)
            continue
        match = _EXPERT.match(target)
        module = experts.get(match["prefix"]) if match else None
        if module is not None and match["proj"] in EXPERT_PROJECTIONS and int(match["expert"]) < module.num_experts:
            scale = match["kind"] == "weight_scale_inv"  # an FP8 expert's block factors
            module.load_expert(int(match["expert"]), match["proj"], tensor, scale)  # False: another rank's expert
            proj = _CANONICAL_PROJ.get(match["proj"], match["proj"])
            consumed.update((name, f"{match['prefix']}.{match['expert']}.{proj}.{match['kind']}"))
            continue
        param = params.get(target)
        if param is None:
            continue
        copy_param(param, tensor, name)
        consumed.update((name, target))
    return consumed


def expert_filter(model: nn.Module, rename: Rename) -> Callable[[str], bool]:
    """Whether the model reads a checkpoint tensor: False for a routed expert's tensor no local
    slot holds (another expert-parallel rank's), which the loader then skips unread."""
    modules = _expert_modules(model)
    held = {prefix: set(m.local_experts) for prefix, m in modules.items()}

    def reads(name: str) -> bool:
        target = rename(name)
        match = _EXPERT.match(target) if target else None
        if match is None or match["prefix"] not in held:
            return True
        expert = int(match["expert"])
        # an expert the model does not have is read, so that the loader names it as unused
        return expert in held[match["prefix"]] or expert >= modules[match["prefix"]].num_experts

    return reads


def expected_weight_names(model: nn.Module) -> list[str]:
    """Canonical names a complete checkpoint fills: plain parameters and per-expert tensors."""
    experts = _expert_modules(model)
    stacked = {
        f"{prefix}.{p}"
        for prefix in experts
        for p in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
    }
    names = [n for n, _ in model.named_parameters() if n not in stacked]
    for prefix, module in experts.items():
        names += module.checkpoint_names(prefix)
    return names
