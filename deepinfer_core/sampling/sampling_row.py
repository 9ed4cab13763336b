"""`SamplingRow`: what the sampler and the logit edits read about one row of logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from deepinfer_core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the request's prompt
    output_token_ids: Sequence[int]  # tokens generated so far (before this step)
    generator: Optional[torch.Generator]  # per-request RNG (on the logits' device) when params.seed is set
    eos_token_id: Optional[int] = None  # banned while len(output_token_ids) < params.min_tokens
