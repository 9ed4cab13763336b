"""Maps a checkpoint's architecture to the model class that runs it.

Entries name a module path and a class, imported only when asked for, so importing the
registry costs nothing and one family's import error cannot break another family.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_LLAMA = ("deepinfer_core.models.llama", "LlamaForCausalLM")

# HF architecture name -> (module path, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
}

# config `model_type` -> architecture, for configs without an `architectures` list
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _architectures(hf_config: dict[str, Any]) -> list[str]:
    archs = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type")
    if not archs and model_type in _MODEL_TYPES:
        archs.append(_MODEL_TYPES[model_type])
    return archs


def get_model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    """The class for the first supported entry of the config's `architectures` (or `model_type`).

    Raises:
        ValueError: nothing in the config is supported; names what it asked for and what is.
    """
    for arch in _architectures(hf_config):
        if arch in _MODELS:
            module_path, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_path), class_name)
    asked = hf_config.get("architectures") or hf_config.get("model_type") or "<none given>"
    raise ValueError(
        f"unsupported model architecture {asked} (model_type={hf_config.get('model_type')!r}); "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
