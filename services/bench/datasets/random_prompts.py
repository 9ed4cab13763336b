"""`random`: prompts of random tokens, lengths drawn around --random-input-len / --random-output-len."""

from __future__ import annotations

import random

from services.bench.datasets.options import DatasetOptions, make_prompt, sample_len
from services.bench.records import BenchRequest
from services.bench.tokens import TokenSource


def build(options: DatasetOptions, tokens: TokenSource) -> list[BenchRequest]:
    rng = random.Random(options.seed)
    requests = []
    for _ in range(options.num_prompts):
        input_len = sample_len(rng, options.random_input_len, options.random_range_ratio)
        output_len = sample_len(rng, options.random_output_len, options.random_range_ratio)
        prompt, prompt_len = make_prompt(rng, tokens, input_len, options.token_ids)
        requests.append(BenchRequest(prompt, prompt_len, output_len))
    return requests
