"""transformers on the engine's own tensors: the baseline `generate` runs on the same weights
without a second copy."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _engine_view(name: str, shape: torch.Size, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The engine tensor (or a view of it) that HF's parameter `name` is: same names for everything
    but the experts; transformers 5 stacks them as gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    (the engine's w13 / w2), transformers 4 keeps experts.{e}.{gate,up,down}_proj.weight."""
    tensor = params.get(name)
    if tensor is None and (m := _STACKED.match(name)):
        tensor = params.get(f"{m['prefix']}.{'w13_weight' if m['proj'] == 'gate_up_proj' else 'w2_weight'}")
    if tensor is None and (m := _PER_EXPERT.match(name)):
        e, w13 = int(m["e"]), params.get(f"{m['prefix']}.w13_weight")
        if w13 is not None:
            inter = w13.shape[1] // 2
            tensor = {"gate_proj": w13[e, :inter], "up_proj": w13[e, inter:]}.get(m["proj"])
            if tensor is None:
                tensor = params[f"{m['prefix']}.w2_weight"][e]
    if tensor is None:
        raise KeyError(f"transformers parameter {name!r} has no counterpart in the engine's model")
    if tensor.shape != shape and tensor.dim() == 3 and tensor.transpose(1, 2).shape == shape:
        tensor = tensor.transpose(1, 2)  # an [E, in, out] expert layout
    if tensor.shape != shape:
        raise ValueError(f"{name}: engine tensor {tuple(tensor.shape)}, transformers wants {tuple(shape)}")
    return tensor.detach()


def hf_model_sharing(model: nn.Module, hf_config: dict[str, Any], device: str):
    """A transformers Qwen3-MoE model whose parameters ARE the engine model's tensors (built on the
    meta device, parameters assigned; modules with computed buffers, the rotary embedding, rebuilt
    on `device`)."""
    import transformers

    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = transformers.Qwen3MoeConfig(**fields)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
    params = dict(model.named_parameters())
    state = {name: _engine_view(name, p.shape, params) for name, p in hf.named_parameters()}
    hf.load_state_dict(state, strict=True, assign=True)
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device(device):
                rebuilt = type(module)(getattr(module, "config", config))
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, attr, rebuilt)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model still has meta tensors: {left[:5]}")
    return hf.eval()
