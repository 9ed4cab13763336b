"""Turns one step's logits into one token per request, with vLLM's sampling semantics.

Order: penalties -> min_tokens ban -> (greedy: argmax) | (temperature -> top-k ->
top-p -> min-p -> draw). Everything is vectorised over rows and runs on the
logits' device in float32. Draws use the exponential race (argmax of p / q,
q ~ Exp(1)), which samples exactly from p; a request with its own generator
fills its own q row, so its tokens do not depend on the rest of the batch.
Returned logprobs come from the raw logits (see `logprobs.py`).

`Sampler.queue()` does all of this on the device and reads nothing back (no host sync):
the engine queues it right behind the forward, and `QueuedSample.to_host()` at the
step's sample-end sync is the only wait. `Sampler.__call__` is both at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.sampling.logprobs import QueuedLogprobs, compute_prompt_logprobs, queue_logprobs
from deepinfer_core.sampling.penalties import apply_min_tokens_mask, apply_penalties
from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.worker.events import HostCopy, to_device

__all__ = ["QueuedSample", "Sampler", "SamplerOutput", "compute_prompt_logprobs", "processed_probs"]


@dataclass
class SamplerOutput:
    """One step's sampled tokens (and logprobs) for the N rows, in row order."""

    token_ids: list[int]  # one sampled token per row
    logprobs: Optional[list[float]]  # raw logprob of the sampled token per row; None if no row asked
    top_logprobs: Optional[list[Optional[dict[int, float]]]]  # per row: top params.logprobs + sampled token


@dataclass
class QueuedSample:
    """One step's sampling, queued on the device and not read back yet."""

    token_ids: torch.Tensor  # [N] int64 on the logits' device, one sampled token per row
    logprobs: Optional[QueuedLogprobs]  # None if no row asked for logprobs
    asking: list[bool]  # per row: whether it asked for logprobs
    _copy: HostCopy = field(init=False, repr=False)

    def __post_init__(self) -> None:  # the read-back starts now, behind the sampling kernels
        self._copy = HostCopy([self.token_ids])

    def to_host(self) -> SamplerOutput:
        """Read the sample back: this waits for the device (for this step's sampling only)."""
        token_ids = self._copy.wait()[0].tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        chosen, tops = self.logprobs.to_host()
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen,
            top_logprobs=[top if ask else None for top, ask in zip(tops, self.asking, strict=True)],
        )


class Sampler:
    """Stateless; the caller's logits are never modified (work happens on a float32 copy)."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` ([N, V], any float dtype and device)."""
        return self.queue(logits, rows).to_host()

    def queue(self, logits: torch.Tensor, rows: list[SamplingRow]) -> QueuedSample:
        """Queue the sampling of one token per row on the logits' device; nothing is read back.
        Rows are read now: the caller may change them once this returns."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits [N={len(rows)}, V], got {tuple(logits.shape)}")
        work = logits.to(torch.float32, copy=True)  # [N, V]
        apply_penalties(work, rows)
        apply_min_tokens_mask(work, rows)
        token_ids = _pick_tokens(work, rows)  # [N]
        asking = [r.params.logprobs is not None for r in rows]
        if not any(asking):
            return QueuedSample(token_ids, None, asking)
        num_top = [r.params.logprobs or 0 for r in rows]
        return QueuedSample(token_ids, queue_logprobs(logits, token_ids, num_top), asking)


def _pick_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [N] int64
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == len(rows):
        return logits.argmax(dim=-1)
    if not greedy:
        return _sample(logits, rows)
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy_idx, random_idx = _long(greedy, logits.device), _long(random, logits.device)
    token_ids[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
    token_ids[random_idx] = _sample(logits[random_idx], [rows[i] for i in random])
    return token_ids


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [n] int64
    """Draw from non-greedy rows; `logits` ([n, V] float32) may be edited in place."""
    return _exponential_race(processed_probs(logits, rows), [r.generator for r in rows])


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [n, V]
    """The distribution a non-greedy row draws from: temperature, top-k, top-p, min-p, softmax.
    `logits` ([n, V] float32) may be edited in place. Speculative decoding verifies against it."""
    temperature = _float([r.params.temperature for r in rows], logits.device)  # [n]
    logits.div_(temperature[:, None])
    logits = _apply_top_k_top_p(logits, rows)
    _apply_min_p(logits, rows)
    return logits.softmax(dim=-1)


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
        q[_long(shared, probs.device)] = torch.empty(len(shared), probs.shape[-1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return probs.div_(q).argmax(dim=-1)


def replay_draws(generator: Optional[torch.Generator], vocab_size: int, params: SamplingParams) -> None:
    """Advance a request's generator past what one sampled token takes from it (`_exponential_race`:
    one Exp(1) row of the vocabulary's width; greedy draws nothing). An engine that continues a
    request another engine began (a CE after the PE's first token) then draws what a single
    engine would have drawn next, so seeded sampling gives the same tokens either way."""
    if generator is None or params.is_greedy:
        return
    torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)
