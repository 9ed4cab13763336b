"""Maps a checkpoint's architecture to the model class that runs it.

Entries name a module path and a class, imported only when asked for, so importing the
registry costs nothing and one family's import error cannot break another family.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_LLAMA = ("deepinfer_core.models.llama", "LlamaForCausalLM")
_DEEPSEEK = ("deepinfer_core.models.deepseek_v3", "DeepseekV3ForCausalLM")
_MOE = ("deepinfer_core.models.qwen3_moe", "Qwen3MoeForCausalLM")
_LLAVA = ("deepinfer_core.models.llava", "LlavaForConditionalGeneration")

# HF architecture name -> (module path, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "Qwen3MoeForCausalLM": _MOE,
    "MixtralForCausalLM": _MOE,
    "LlavaForConditionalGeneration": _LLAVA,
}

# HF architecture name -> its vision encoder alone (what a vision-encoder process loads)
_VISION_ENCODERS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("deepinfer_core.models.llava", "LlavaVisionEncoder"),
}

# config `model_type` -> architecture, for configs without an `architectures` list
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llava": "LlavaForConditionalGeneration",
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


def get_vision_encoder_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    """The vision encoder (tower + projector) of a multimodal architecture.

    Raises:
        ValueError: the architecture has no vision encoder here.
    """
    for arch in _architectures(hf_config):
        if arch in _VISION_ENCODERS:
            module_path, class_name = _VISION_ENCODERS[arch]
            return getattr(importlib.import_module(module_path), class_name)
    raise ValueError(
        f"model architecture {hf_config.get('architectures') or hf_config.get('model_type')} has no vision encoder; "
        f"multimodal architectures: {', '.join(sorted(_VISION_ENCODERS))}"
    )
