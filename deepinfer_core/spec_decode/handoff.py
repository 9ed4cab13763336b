"""What a CE needs from the PE to draft from its first decode step: the target's last hidden state
at the prompt's last position (the MTP layer's input beside the first token's embedding).

It rides in the hand-off notice (`HandoffNotice.last_hidden`: base64 of float32 little-endian
[H]); the PE sends it when the model has an MTP layer, whatever the CE does with it, and a CE
without drafts ignores it. The MTP layer's own KV for the prompt is not handed over (a PE loads no
draft weights and so computes none): the CE zeroes that part of its draft cache, so the first
drafts attend to the last position only, deterministically; greedy output is the same either way
(verification), only early acceptance is lower than on a NORMAL engine.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode_hidden(hidden: torch.Tensor) -> str:
    """[H] (any dtype, any device) -> the notice's string."""
    return base64.b64encode(hidden.detach().float().cpu().numpy().astype("<f4").tobytes()).decode()


def decode_hidden(data: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The notice's string -> [H] on `device` in `dtype`."""
    values = np.frombuffer(base64.b64decode(data), dtype="<f4").copy()
    return torch.from_numpy(values).to(device=device, dtype=dtype)


def has_mtp_layer(hf_config: dict, builtin: bool) -> bool:
    """Whether the checkpoint carries an MTP layer (the built-in model always makes one)."""
    text = hf_config.get("text_config") or hf_config
    return builtin or bool(text.get("num_nextn_predict_layers"))
