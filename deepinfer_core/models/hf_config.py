"""Reads a checkpoint's config.json and fills the keys older or terser configs leave out.

Model code then reads one spelling of each setting: `head_dim`, `num_key_value_heads`, and the
RoPE settings as `rope_parameters` (plus `rope_theta` and a `rope_scaling` that is None unless
the RoPE is scaled), whichever of the transformers-4 or -5 spellings the file used.
"""

from __future__ import annotations

import json
import os
from typing import Any

from deepinfer_core.models.layers.rotary import rope_parameters


def load_hf_config(path: str) -> dict[str, Any]:
    """Parse `<path>/config.json` and normalise it.

    Raises:
        FileNotFoundError: the directory or its config.json is missing (the message names it).
        ValueError: config.json is not a valid JSON object.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return normalize_hf_config(config)


# settings the engine reads from the top level, lifted from a multimodal config's `text_config`
_TEXT_KEYS = ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_scaling")


def normalize_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with defaults filled in; idempotent. A multimodal wrapper (a config with
    a `text_config`) gets its text config normalised and the text settings the engine reads
    (vocabulary, context length, special tokens) copied to the top level where it lacks them."""
    config = dict(config)
    if isinstance(config.get("text_config"), dict):
        text = normalize_hf_config(config["text_config"])
        config["text_config"] = text
        for key in _TEXT_KEYS:
            if config.get(key) is None and text.get(key) is not None:
                config[key] = text[key]
    heads = config.get("num_attention_heads")
    if heads is None:
        return config
    if not config.get("head_dim"):
        config["head_dim"] = config["hidden_size"] // heads
    if not config.get("num_key_value_heads"):
        config["num_key_value_heads"] = heads
    if "max_position_embeddings" in config:
        params = rope_parameters(config)
        config["rope_parameters"] = params
        config["rope_theta"] = params["rope_theta"]
        config["rope_scaling"] = dict(params) if params["rope_type"] != "default" else None
    return config


def num_routed_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model), whatever the family calls them; a
    multimodal wrapper's are its language model's."""
    if isinstance(config.get("text_config"), dict):
        return num_routed_experts(config["text_config"])
    return int(config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0)
