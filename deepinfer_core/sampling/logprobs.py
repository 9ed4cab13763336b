"""Log-probabilities returned to clients, computed from the raw model logits.

Like vLLM's default ("raw_logprobs"), they describe the model's distribution, not
the penalised/tempered one the token was drawn from. Rows are processed in
chunks so that prompt logprobs of a long prompt never materialise a full
[L, V] float32 log-softmax. `queue_logprobs` only queues device work; its
`to_host()` is the read-back (the engine does it at the step's sample-end sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.worker.events import HostCopy, to_device

_CHUNK_ELEMENTS = 1 << 24  # ~64 MiB of float32 per chunk


@dataclass
class QueuedLogprobs:
    """Logprobs computed on the device and not yet read back (no host sync has happened)."""

    token_ids: torch.Tensor  # [N] int64: the token each row scores
    chosen: torch.Tensor  # [N] float32: logprob of token_ids[i]
    top_ids: Optional[torch.Tensor]  # [N, K] int64, K = max(num_top) capped at V; None when K == 0
    top_logprobs: Optional[torch.Tensor]  # [N, K] float32
    num_top: list[int]
    _copy: HostCopy = field(init=False, repr=False)

    def __post_init__(self) -> None:  # the read-back starts now, behind the kernels that fill it
        self._copy = HostCopy([self.chosen, self.token_ids, self.top_ids, self.top_logprobs])

    def to_host(self) -> tuple[list[float], list[dict[int, float]]]:
        """(logprob of token_ids[i] per row, {token id: logprob} per row); waits for the device."""
        chosen_t, tokens_t, top_ids_t, top_lps_t = self._copy.wait()
        chosen = chosen_t.tolist()
        tokens = tokens_t.tolist()
        top_ids = top_ids_t.tolist() if top_ids_t is not None else None
        top_lps = top_lps_t.tolist() if top_lps_t is not None else None
        dicts = []
        for i in range(len(chosen)):
            k = self.num_top[i] if top_ids is not None else 0
            entry = dict(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if k else {}
            entry[tokens[i]] = chosen[i]
            dicts.append(entry)
        return chosen, dicts


def queue_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> QueuedLogprobs:
    """Queue the logprob computation of `gather_logprobs` on the logits' device; read nothing back."""
    n, vocab = logits.shape
    max_top = min(max(num_top, default=0), vocab)
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    chosen: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    top_lps: list[torch.Tensor] = []
    for start in range(0, n, step):
        chunk = logits[start : start + step].float()  # [c, V]
        lse = chunk.logsumexp(dim=-1, keepdim=True)  # [c, 1]
        tokens = token_ids[start : start + step, None]  # [c, 1]
        chosen.append((chunk.gather(-1, tokens) - lse).squeeze(-1))
        if max_top > 0:
            values, ids = chunk.topk(max_top, dim=-1)  # [c, max_top]
            top_ids.append(ids)
            top_lps.append(values - lse)
    empty = torch.empty(0, dtype=torch.float32, device=logits.device)
    return QueuedLogprobs(
        token_ids=token_ids,
        chosen=torch.cat(chosen) if chosen else empty,
        top_ids=torch.cat(top_ids) if top_ids else None,
        top_logprobs=torch.cat(top_lps) if top_lps else None,
        num_top=list(num_top),
    )


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
    return queue_logprobs(logits, token_ids, num_top).to_host()


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
    targets = to_device(list(prompt_token_ids[1:]), torch.long, logits.device)  # [P-1]
    _, dicts = gather_logprobs(logits[: num_prompt - 1], targets, [num_top] * (num_prompt - 1))
    return [None, *dicts]
