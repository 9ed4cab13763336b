"""n > 1: one request becomes n single-sample sub-requests (seeds seed + i); the router merges
them back (`services.common.stream_merge`).

Prefill and decode engines take n = 1 (a CE reserves for one sequence), so the fan-out
happens before prefill; with a seed, sample i draws from seed + i, as the engine does for
an n > 1 request of its own.
"""

from __future__ import annotations

from deepinfer_core.sampling_params import SamplingParams


def split_samples(params: SamplingParams) -> list[SamplingParams]:
    samples = []
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if params.seed is not None:
            p.seed = params.seed + i
        if i > 0:
            p.prompt_logprobs = None  # reported once, with sample 0
        samples.append(p)
    return samples
