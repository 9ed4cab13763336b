"""Datasets: each turns `DatasetOptions` into the list of requests a run sends, in order."""

from __future__ import annotations

from collections.abc import Callable

from services.bench.datasets import images, random_prompts, shared_prefix, sharegpt
from services.bench.datasets.options import DatasetOptions, make_prompt, sample_len
from services.bench.records import BenchRequest
from services.bench.tokens import TokenSource

__all__ = ["DATASETS", "DatasetOptions", "load_dataset", "make_prompt", "sample_len"]


def load_dataset(options: DatasetOptions, tokens: TokenSource) -> list[BenchRequest]:
    """Raises ValueError (or FileNotFoundError) with a message naming what is wrong."""
    builders: dict[str, Callable[[DatasetOptions, TokenSource], list[BenchRequest]]] = {
        "random": random_prompts.build,
        "shared-prefix": shared_prefix.build,
        "sharegpt": sharegpt.build,
        "random-mm": images.build,
    }
    if options.name not in builders:
        raise ValueError(f"unknown dataset {options.name!r}; choose one of {', '.join(DATASETS)}")
    if options.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    return builders[options.name](options, tokens)


DATASETS = ("random", "shared-prefix", "sharegpt", "random-mm")
