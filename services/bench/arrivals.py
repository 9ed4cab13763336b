"""When each request is sent: a Poisson process, or a gamma process for burstier traffic."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent; the first at 0.

    Gaps are gamma-distributed with mean 1 / rate and shape `burstiness`: 1 is a Poisson process,
    below 1 burstier (same mean, larger spread), above 1 steadier, infinite a constant rate (every
    gap 1 / rate, as guidellm's `constant` profile sends). An infinite rate sends all at once.
    """
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, not {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, not {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [i / rate for i in range(n)]
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
