"""Loading the draft (MTP) model beside the target, only on an engine that drafts.

A PE never calls this (`SchedulerConfig.num_speculative_tokens` is 0 for its role), so it reads
none of the draft-only tensors. The MTP layer of the built-in tiny model and of random
(`load_format="dummy"`) weights is made from the target without touching the target's draws: its
block is the target's last layer, its embedding and head the target's
(`init_from_target_last_layer`), so its drafts are sometimes right; a layer drawn at random would
never be.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.mtp import DeepseekMTP


def text_config(model_config: ModelConfig) -> dict:
    hf = normalize_hf_config(model_config.hf_config)
    return normalize_hf_config(hf["text_config"]) if "text_config" in hf else hf


def load_mtp(model_config: ModelConfig, device: torch.device, target: nn.Module) -> DeepseekMTP:
    """The MTP draft layer of `model_config`'s checkpoint on `device`, eval mode.

    Raises:
        ValueError: the model is no DeepSeek-V3 with `num_nextn_predict_layers` >= 1 (the built-in
            model always has one), or the checkpoint's MTP tensors are incomplete.
    """
    from deepinfer_core.models.loader import load_checkpoint, read_tensor_names, weight_files
    from deepinfer_core.models.quantization import fp8_block_size

    cfg = text_config(model_config)
    if not model_config.builtin and not cfg.get("num_nextn_predict_layers"):
        raise ValueError(
            f"speculative decoding needs an MTP layer: {model_config.path} has no num_nextn_predict_layers "
            f"(model_type {cfg.get('model_type')!r})"
        )
    if cfg.get("model_type") != "deepseek_v3":
        raise ValueError(f"MTP drafting supports DeepSeek-V3 checkpoints, not {cfg.get('model_type')!r}")
    with torch.device(device):
        mtp = DeepseekMTP(cfg, model_config.dtype)
    if model_config.builtin or model_config.load_format == "dummy":
        init_from_target_last_layer(mtp, target)  # before any graph capture reads its tensors
    else:
        shards = read_tensor_names(weight_files(model_config.path))
        held = {f: [n for n in names if mtp.rename(n) is not None] for f, names in shards.items()}
        if not any(held.values()):
            raise ValueError(
                f"speculative decoding needs an MTP layer: {model_config.path} holds no "
                f"model.layers.{mtp.layer_index}.* tensors"
            )
        load_checkpoint(mtp, {f: n for f, n in held.items() if n}, fp8_block_size(cfg))
    return mtp.eval()


def init_from_target_last_layer(mtp: DeepseekMTP, target: nn.Module) -> None:
    """A draft that looks trained for benchmarks on random weights: the decoder block is a copy of the
    target's last layer, the embedding and head are the target's, `eh_proj` passes the target's
    hidden state through (its embedding half zero), so the draft re-applies the last layer."""
    lm = getattr(target, "language_model", target)
    last = lm.model.layers[-1]
    with torch.no_grad():
        for name, param in mtp.block.named_parameters():
            param.copy_(last.get_parameter(name))
        h = mtp.args.hidden_size
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, h:].copy_(torch.eye(h, dtype=mtp.eh_proj.weight.dtype))
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(lm.model.norm.weight)
    mtp.share_target_embeddings(target)
