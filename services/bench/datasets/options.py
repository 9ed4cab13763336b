"""What every dataset builder shares: the options of a run's dataset and random prompts and lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from services.bench.tokens import TokenSource


@dataclass(frozen=True)
class DatasetOptions:
    name: str
    """One of DATASETS."""
    num_prompts: int
    """Requests to make (shared-prefix makes groups x prompts per group instead)."""
    seed: int = 0
    path: Optional[str] = None
    """The ShareGPT JSON file."""
    token_ids: bool = False
    """Prompts as token ids instead of text (random and shared-prefix; the completions endpoint only)."""
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    """Lengths are drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    sharegpt_output_len: Optional[int] = None
    """Every request's max_tokens; default: the length of the conversation's own reply."""
    shared_prefix_num_groups: int = 8
    shared_prefix_prompts_per_group: int = 16
    shared_prefix_len: int = 512
    """Tokens of the prefix all prompts of a group share."""
    shared_prefix_suffix_len: int = 128
    """Tokens after the prefix, different for each prompt."""
    random_mm_base_items_per_request: int = 1
    """Images per request (random-mm)."""
    random_mm_image_size: tuple[int, int] = (64, 64)
    """Width and height of each image in pixels."""


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length drawn uniformly from [length * (1 - r), length * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {range_ratio}")
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def make_prompt(rng: random.Random, tokens: TokenSource, length: int, token_ids: bool) -> tuple[str | list[int], int]:
    """A random prompt of `length` tokens (as ids or text) and its token count."""
    if token_ids:
        return tokens.random_ids(rng, length), length
    return tokens.random_text(rng, length)
