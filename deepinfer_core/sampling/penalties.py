"""Logit edits that depend on what a request has already seen or produced.

Repetition, presence and frequency penalties and the `min_tokens` ban all turn
per-row token lists into a few indexed writes on the whole [N, V] logits, so a
batch costs one tensor build per step instead of a Python loop over the vocab.
They are applied before temperature, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import torch

from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.worker.events import to_device


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply repetition (prompt + output) then presence/frequency (output) penalties in place.

    Args:
        logits: [N, V] float32, one row per entry of `rows`; edited in place.
        rows: the requests behind the logits rows.
    """
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        _apply_repetition_penalty(logits, [rows[i] for i in rep], rep)
    pf = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if pf:
        _apply_presence_frequency(logits, [rows[i] for i in pf], pf)


def apply_min_tokens_mask(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Ban stop token ids and EOS (unless ignore_eos) for rows still short of `min_tokens`.

    Args:
        logits: [N, V] float32; the banned entries are set to -inf in place.
        rows: the requests behind the logits rows.
    """
    row_idx: list[int] = []
    tok_idx: list[int] = []
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        banned = set(row.params.stop_token_ids or ())
        if row.eos_token_id is not None and not row.params.ignore_eos:
            banned.add(row.eos_token_id)
        banned = {t for t in banned if t < vocab}
        row_idx.extend([i] * len(banned))
        tok_idx.extend(banned)
    if row_idx:
        index = (_long(row_idx, logits.device), _long(tok_idx, logits.device))
        logits.index_put_(index, torch.full((), float("-inf"), device=logits.device))


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    counts = _token_counts(
        [chain(r.prompt_token_ids, r.output_token_ids) for r in rows],
        [len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows],
        logits.shape[-1],
        logits.device,
    )  # [n, V]
    penalty = _float([r.params.repetition_penalty for r in rows], logits.device)[:, None]  # [n, 1]
    index = _long(idx, logits.device)
    sub = logits[index]  # [n, V] (copy)
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[index] = torch.where(counts > 0, penalised, sub)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    counts = _token_counts(
        [r.output_token_ids for r in rows],
        [len(r.output_token_ids) for r in rows],
        logits.shape[-1],
        logits.device,
    )  # [n, V] float32
    freq = _float([r.params.frequency_penalty for r in rows], logits.device)[:, None]  # [n, 1]
    pres = _float([r.params.presence_penalty for r in rows], logits.device)[:, None]  # [n, 1]
    logits[_long(idx, logits.device)] -= freq * counts + pres * (counts > 0)


def _token_counts(
    token_lists: list[Iterable[int]], lengths: list[int], vocab: int, device: torch.device
) -> torch.Tensor:  # [n, V] float32
    """How often each token occurs in each row's token list (ids >= vocab are ignored)."""
    counts = torch.zeros(len(lengths), vocab + 1, dtype=torch.float32, device=device)
    if sum(lengths) == 0:
        return counts[:, :vocab]
    tokens = _long(list(chain.from_iterable(token_lists)), device).clamp_(max=vocab)  # [T]
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), _long(lengths, device), output_size=tokens.shape[0]
    )  # [T]; output_size given: no read-back of the lengths
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts[:, :vocab]


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)
