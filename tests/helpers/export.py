"""Hand one of our loaded models' weights to transformers.

- `export_checkpoint`: a real HF checkpoint (config.json + safetensors in checkpoint names:
  stacked experts split into `experts.<e>.{gate,up,down}_proj.weight`, a tied head left out);
- `hf_llava_state_dict`: the same weights under the in-memory names of transformers'
  `LlavaForConditionalGeneration` (`model.language_model.*`, experts fused as `gate_up_proj`
  [E, 2I, H] / `down_proj` [E, H, I], the layout ours already has), for `load_state_dict`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from deepinfer_core.models.layers.moe import FusedExperts

_STACKED = ("w13_weight", "w2_weight")


def _experts(model: nn.Module) -> dict[str, FusedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedExperts)}


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    experts = _experts(model)
    stacked = {f"{prefix}.{p}" for prefix in experts for p in _STACKED}
    out = {name: p.detach().clone() for name, p in model.named_parameters() if name not in stacked}
    for prefix, module in experts.items():
        inter = module.intermediate_size
        for i, e in enumerate(module.local_experts):
            w13 = module.w13_weight[i].detach()
            out[f"{prefix}.{e}.gate_proj.weight"] = w13[:inter].clone()
            out[f"{prefix}.{e}.up_proj.weight"] = w13[inter:].clone()
            out[f"{prefix}.{e}.down_proj.weight"] = module.w2_weight[i].detach().clone()
    return out


def export_checkpoint(model: nn.Module, hf_config: dict, directory: str | os.PathLike) -> None:
    """`config.json` + `model.safetensors` of `model` in `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    save_file(hf_state_dict(model), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def hf_llava_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our LLaVA's parameters under transformers-5 `LlavaForConditionalGeneration` names."""
    renames = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}
    out = {}
    for name, p in model.named_parameters():
        head, _, last = name.rpartition(".")
        if last in renames and head.endswith(".experts"):
            name = f"{head}.{renames[last]}"
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        else:
            name = "model." + name
        out[name] = p.detach().clone()
    return out
