"""`sharegpt`: real conversations from a local ShareGPT-format JSON file (--dataset-path).

The file is a JSON list of entries, each with a "conversations" list of turns
({"from": "human" | "gpt", "value": text}; {"role", "content"} turns are read too). A request is
an entry's first turn as the prompt, with the reply after it setting max_tokens (or
--sharegpt-output-len). Entries with fewer than two turns, or very short or very long ones, are
skipped; the rest are shuffled with --seed, and reused when there are fewer than --num-prompts.
"""

from __future__ import annotations

import json
import random
from typing import Any

from services.bench.datasets.options import DatasetOptions
from services.bench.records import BenchRequest
from services.bench.tokens import TokenSource

_MIN_LEN = 4
"""Fewer prompt or reply tokens than this: too short to tell a serving stack anything."""
_MAX_PROMPT_LEN = 1024
_MAX_TOTAL_LEN = 2048
"""Longer conversations are skipped, so that the dataset fits models with a 2k context."""


def build(options: DatasetOptions, tokens: TokenSource) -> list[BenchRequest]:
    if not options.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
    entries = _read(options.path)
    rng = random.Random(options.seed)
    order = list(range(len(entries)))
    rng.shuffle(order)
    requests = []
    for index in order:
        request = _request(entries[index], index, options, tokens)
        if request is not None:
            requests.append(request)
        if len(requests) == options.num_prompts:
            return requests
    if not requests:
        raise ValueError(f"{options.path}: no conversation with a prompt and a reply of usable length")
    usable = list(requests)
    while len(requests) < options.num_prompts:
        requests.append(rng.choice(usable))
    return requests


def _read(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, found a {type(data).__name__}")
    return data


def _request(entry: Any, index: int, options: DatasetOptions, tokens: TokenSource) -> BenchRequest | None:
    turns = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        raise ValueError(f"{options.path}: entry {index} has no 'conversations' list")
    if len(turns) < 2:
        return None
    prompt, reply = _text(turns[0], index, options.path), _text(turns[1], index, options.path)
    prompt_len = tokens.count(prompt)
    output_len = options.sharegpt_output_len or tokens.count(reply)
    if prompt_len < _MIN_LEN or (output_len < _MIN_LEN and options.sharegpt_output_len is None):
        return None
    if prompt_len > _MAX_PROMPT_LEN or prompt_len + output_len > _MAX_TOTAL_LEN:
        return None
    return BenchRequest(prompt, prompt_len, output_len)


def _text(turn: Any, index: int, path: str) -> str:
    value = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
    if not isinstance(value, str):
        raise ValueError(f"{path}: entry {index} has a turn without a 'value' string")
    return value
