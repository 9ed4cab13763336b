"""`shared-prefix`: groups of prompts that start with the same prefix, to exercise prefix caching.

Each of --shared-prefix-num-groups groups has one random prefix of --shared-prefix-len tokens;
its --shared-prefix-prompts-per-group prompts append their own --shared-prefix-suffix-len tokens.
The requests are shuffled, so a group's prompts do not arrive back to back.
"""

from __future__ import annotations

import random

from services.bench.datasets.options import DatasetOptions, make_prompt, sample_len
from services.bench.records import BenchRequest
from services.bench.tokens import TokenSource


def build(options: DatasetOptions, tokens: TokenSource) -> list[BenchRequest]:
    if options.shared_prefix_num_groups < 1 or options.shared_prefix_prompts_per_group < 1:
        raise ValueError("--shared-prefix-num-groups and --shared-prefix-prompts-per-group must be at least 1")
    rng = random.Random(options.seed)
    requests = []
    for _ in range(options.shared_prefix_num_groups):
        prefix, prefix_len = make_prompt(rng, tokens, options.shared_prefix_len, options.token_ids)
        for _ in range(options.shared_prefix_prompts_per_group):
            suffix, _ = make_prompt(rng, tokens, options.shared_prefix_suffix_len, options.token_ids)
            output_len = sample_len(rng, options.random_output_len, options.random_range_ratio)
            requests.append(_joined(prefix, suffix, tokens, output_len))
    rng.shuffle(requests)
    return requests


def _joined(prefix: str | list[int], suffix: str | list[int], tokens: TokenSource, output_len: int) -> BenchRequest:
    if isinstance(prefix, list):
        prompt = prefix + suffix
        return BenchRequest(prompt, len(prompt), output_len)
    text = f"{prefix} {suffix}" if prefix and suffix else prefix + suffix
    return BenchRequest(text, tokens.count(text), output_len)
