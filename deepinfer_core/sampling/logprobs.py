"""Log-probabilities returned to clients, computed from the raw model logits.

Like vLLM's default ("raw_logprobs"), they describe the model's distribution, not
the penalised/tempered one the token was drawn from. Rows are processed in
chunks so that prompt logprobs of a long prompt never materialise a full
[L, V] float32 log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

_CHUNK_ELEMENTS = 1 << 24  # ~64 MiB of float32 per chunk


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> tuple[list[float], list[dict[int, float]]]:
    """Per row: the logprob of `token_ids[i]` and a dict of it plus the top `num_top[i]` tokens.

    Args:
        logits: [N, V] raw logits, any float dtype.
        token_ids: [N] int64 on the logits' device: the token whose logprob is wanted.
        num_top: N ints >= 0: how many top tokens each row's dict holds besides `token_ids[i]`.

    Returns:
        (logprob of token_ids[i] per row, {token id: logprob} per row).
    """
    n, vocab = logits.shape
    max_top = min(max(num_top, default=0), vocab)
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for start in range(0, n, step):
        chunk = logits[start : start + step].float()  # [c, V]
        lse = chunk.logsumexp(dim=-1, keepdim=True)  # [c, 1]
        tokens = token_ids[start : start + step, None]  # [c, 1]
        chosen.extend((chunk.gather(-1, tokens) - lse).squeeze(-1).tolist())
        if max_top > 0:
            values, ids = chunk.topk(max_top, dim=-1)  # [c, max_top]
            top_ids.extend(ids.tolist())
            top_lps.extend((values - lse).tolist())
    tokens_list = token_ids.tolist()
    dicts = []
    for i in range(n):
        k = num_top[i] if max_top > 0 else 0
        entry = dict(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if k else {}
        entry[tokens_list[i]] = chosen[i]
        dicts.append(entry)
    return chosen, dicts


def compute_prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: Sequence[int], num_top: int
) -> list[Optional[dict[int, float]]]:
    """vLLM-style prompt logprobs: entry 0 is None, entry i scores prompt token i from logits row i-1.

    Args:
        logits: [L, V] logits at prompt positions 0..L-1, L >= len(prompt) - 1 (rows past that are unused).
        prompt_token_ids: the prompt, P tokens.
        num_top: how many top tokens each entry holds besides the prompt token itself.

    Returns:
        P entries: None, then {prompt_token_ids[i]: logprob, plus the top num_top tokens} for i >= 1.
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return []
    if logits.shape[0] < num_prompt - 1:
        raise ValueError(f"prompt logprobs need >= {num_prompt - 1} logits rows, got {logits.shape[0]}")
    targets = torch.tensor(list(prompt_token_ids[1:]), dtype=torch.long, device=logits.device)  # [P-1]
    _, dicts = gather_logprobs(logits[: num_prompt - 1], targets, [num_top] * (num_prompt - 1))
    return [None, *dicts]
