"""Turns one step's logits into one token per request, with vLLM's sampling semantics.

Order: penalties -> min_tokens ban -> (greedy: argmax) | (temperature -> top-k ->
top-p -> min-p -> draw). Everything is vectorised over rows and runs on the
logits' device in float32. Draws use the exponential race (argmax of p / q,
q ~ Exp(1)), which samples exactly from p; a request with its own generator
fills its own q row, so its tokens do not depend on the rest of the batch.
Returned logprobs come from the raw logits (see `logprobs.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from deepinfer_core.sampling.logprobs import compute_prompt_logprobs, gather_logprobs
from deepinfer_core.sampling.penalties import apply_min_tokens_mask, apply_penalties
from deepinfer_core.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "compute_prompt_logprobs"]


@dataclass
class SamplingRow:
    """What the sampler needs about one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the request's prompt
    output_token_ids: Sequence[int]  # tokens generated so far (before this step)
    generator: Optional[torch.Generator]  # per-request RNG (on the logits' device) when params.seed is set
    eos_token_id: Optional[int] = None  # banned while len(output_token_ids) < params.min_tokens


@dataclass
class SamplerOutput:
    """One step's sampled tokens (and logprobs) for the N rows, in row order."""

    token_ids: list[int]  # one sampled token per row
    logprobs: Optional[list[float]]  # raw logprob of the sampled token per row; None if no row asked
    top_logprobs: Optional[list[Optional[dict[int, float]]]]  # per row: top params.logprobs + sampled token


class Sampler:
    """Stateless; the caller's logits are never modified (work happens on a float32 copy)."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` ([N, V], any float dtype and device)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits [N={len(rows)}, V], got {tuple(logits.shape)}")
        work = logits.to(torch.float32, copy=True)  # [N, V]
        apply_penalties(work, rows)
        apply_min_tokens_mask(work, rows)
        token_ids = _pick_tokens(work, rows)  # [N]
        return _make_output(logits, token_ids, rows)


def _pick_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [N] int64
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == len(rows):
        return logits.argmax(dim=-1)
    if not greedy:
        return _sample(logits, rows)
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    token_ids[greedy] = logits[greedy].argmax(dim=-1)
    token_ids[random] = _sample(logits[random], [rows[i] for i in random])
    return token_ids


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [n] int64
    """Draw from non-greedy rows; `logits` ([n, V] float32) may be edited in place."""
    temperature = _float([r.params.temperature for r in rows], logits.device)  # [n]
    logits.div_(temperature[:, None])
    logits = _apply_top_k_top_p(logits, rows)
    _apply_min_p(logits, rows)
    probs = logits.softmax(dim=-1)  # [n, V]
    return _exponential_race(probs, [r.generator for r in rows])


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [n, V]
    """Mask to -inf all but each row's top-k, then all but its nucleus (top-p) among those."""
    vocab = logits.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    top_p = [r.params.top_p if r.params.top_p < 1.0 else math.inf for r in rows]
    use_k, use_p = any(top_k), any(p < 1.0 for p in top_p)
    if not use_p:
        if use_k:
            _apply_top_k_unsorted(logits, top_k)
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [n, V]
    if use_k:
        k = _long([k or vocab for k in top_k], logits.device)  # [n]
        kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [n, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [n, V]
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # [n, V]: probability of strictly better tokens
    p = _float(top_p, logits.device)[:, None]  # [n, 1]
    sorted_logits.masked_fill_(mass_before >= p, -math.inf)  # the top token has 0 < p: always kept
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _apply_top_k_unsorted(logits: torch.Tensor, top_k: list[int]) -> None:
    """Top-k without a full sort: threshold each row at its k-th largest logit (ties kept)."""
    k = _long(top_k, logits.device)  # [n], 0 = disabled
    top = logits.topk(max(top_k), dim=-1).values  # [n, max_k]
    kth = top.gather(-1, (k.clamp(min=1) - 1)[:, None])  # [n, 1]
    kth.masked_fill_((k == 0)[:, None], -math.inf)
    logits.masked_fill_(logits < kth, -math.inf)


def _apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    min_p = [r.params.min_p for r in rows]
    if not any(m > 0.0 for m in min_p):
        return
    log_min_p = _float(min_p, logits.device).log()[:, None]  # [n, 1]; log(0) = -inf keeps all
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p  # [n, 1]
    logits.masked_fill_(logits < threshold, -math.inf)


def _exponential_race(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) i.i.d. is a draw from p; rows with a generator draw their own q."""
    q = torch.empty_like(probs)  # [n, V]
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        q.exponential_()
    elif shared:
        q[shared] = torch.empty(len(shared), probs.shape[-1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return probs.div_(q).argmax(dim=-1)


def _make_output(raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    asking = [r.params.logprobs is not None for r in rows]
    if not any(asking):
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None, top_logprobs=None)
    num_top = [r.params.logprobs or 0 for r in rows]
    chosen, tops = gather_logprobs(raw_logits, token_ids, num_top)
    return SamplerOutput(
        token_ids=token_ids.tolist(),
        logprobs=chosen,
        top_logprobs=[top if ask else None for top, ask in zip(tops, asking, strict=True)],
    )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
