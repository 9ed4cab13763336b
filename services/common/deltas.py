"""What one sample's output stream carries between services, and the two ends of it.

An engine reports cumulative outputs (all tokens and all text so far). Between services we
send `SampleDelta`s: the new part and where it starts, so the receiver splices it in
(`tokens[token_offset:] = token_ids`, `text[text_offset:] = text`). Text can move back: a
stop string found at the end is cut off. `OutputDiffer` makes deltas on the engine side;
`SampleAssembler` rebuilds the sample on the router and decides what reaches the client,
holding back the last few characters while a stop string could still be forming. `merge`
folds two consecutive deltas into one, so a reader that fell behind takes one message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from deepinfer_core.outputs import CompletionOutput


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    """Token id -> logprob: the sampled token and the top-k asked for."""


@dataclass
class SampleDelta:
    index: int = 0
    """Which of the request's n samples."""
    token_offset: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_offset: int = 0
    text: str = ""
    logprobs: Optional[list[TokenLogprob]] = None
    """One per token in `token_ids`, when the request asked for logprobs."""
    finish_reason: Optional[str] = None
    """None while running; 'stop', 'length', 'abort', 'error'."""
    stop_reason: Optional[Union[int, str]] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class OutputDiffer:
    """Engine side: cumulative `CompletionOutput`s in, `SampleDelta`s out."""

    def __init__(self, index: int = 0, num_tokens: int = 0, text: str = ""):
        self.index = index
        self.num_tokens = num_tokens
        """Tokens already sent."""
        self.text = text
        """Text already sent."""

    @classmethod
    def after(cls, out: CompletionOutput) -> OutputDiffer:
        """A differ that has already sent `out`: a CE's stream starts after the hand-off's first
        token, which the PE's reply brought to the client."""
        return cls(out.index, len(out.token_ids), out.text)

    def diff(self, out: CompletionOutput, num_cached_tokens: int = 0) -> Optional[SampleDelta]:
        """The delta since the last call; None when nothing changed."""
        finish = out.finish_reason
        start = min(self.num_tokens, len(out.token_ids))
        text_start = _common_prefix(self.text, out.text)
        if start == len(out.token_ids) and text_start == len(out.text) == len(self.text) and finish is None:
            return None
        delta = SampleDelta(
            index=self.index,
            token_offset=start,
            token_ids=list(out.token_ids[start:]),
            text_offset=text_start,
            text=out.text[text_start:],
            logprobs=_logprobs(out, start),
            finish_reason=finish,
            stop_reason=out.stop_reason,
            error=out.error,
            num_cached_tokens=num_cached_tokens,
        )
        self.num_tokens, self.text = len(out.token_ids), out.text
        return delta


def _logprobs(out: CompletionOutput, start: int) -> Optional[list[TokenLogprob]]:
    if out.logprobs is None:
        return None
    result = []
    for tok, top in zip(out.token_ids[start:], out.logprobs[start:]):
        top = top or {}
        result.append(
            TokenLogprob(int(tok), float(top.get(tok, float("nan"))), {int(k): float(v) for k, v in top.items()})
        )
    return result


def merge(a: SampleDelta, b: SampleDelta) -> SampleDelta:
    """One delta that splices in what `a` then `b` did: exact for tokens, logprobs, text that
    moves back (a stop string cut off), the finish and the cached-prompt count. `b` must follow
    `a` in one sample's stream (each offset within what the receiver holds after the one before)."""
    keep = b.token_offset - a.token_offset  # a's tokens that b leaves in place (negative: b cuts further back)
    text_keep = b.text_offset - a.text_offset
    token_offset, token_ids = (
        (a.token_offset, a.token_ids[:keep] + b.token_ids) if keep >= 0 else (b.token_offset, b.token_ids)
    )
    text_offset, text = (a.text_offset, a.text[:text_keep] + b.text) if text_keep >= 0 else (b.text_offset, b.text)
    ended = b if b.finish_reason is not None else a
    return SampleDelta(
        index=b.index,
        token_offset=token_offset,
        token_ids=token_ids,
        text_offset=text_offset,
        text=text,
        logprobs=_merged_logprobs(a, b, keep),
        finish_reason=ended.finish_reason,
        stop_reason=ended.stop_reason,
        error=ended.error,
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
    )


def _merged_logprobs(a: SampleDelta, b: SampleDelta, keep: int) -> Optional[list[TokenLogprob]]:
    """Logprobs beside the merged tokens; None unless every merged token has one (a delta
    without logprobs, such as an abort's, may follow one that has them)."""
    if a.logprobs is None and b.logprobs is None:
        return None
    head = (a.logprobs if a.logprobs is not None else [None] * len(a.token_ids))[:keep] if keep >= 0 else []
    tail = b.logprobs if b.logprobs is not None else [None] * len(b.token_ids)
    merged = head + tail
    return merged if all(lp is not None for lp in merged) else None


class SampleAssembler:
    """Router side: splices deltas from the stages holding a sample (PE, then CE) and hands
    out what the client may see."""

    def __init__(self, index: int, holdback_chars: int = 0):
        self.index = index
        self.holdback = holdback_chars
        """Characters kept back until the sample ends: a stop string's length minus one."""
        self.tokens: list[int] = []
        self.logprobs: list[Optional[TokenLogprob]] = []
        self.text = ""
        self.sent_tokens = 0
        self.sent_chars = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[Union[int, str]] = None
        self.error: Optional[str] = None
        self.num_cached_tokens = 0
        self.done = False

    def apply(self, d: SampleDelta) -> None:
        if d.token_offset <= len(self.tokens):
            self.tokens[d.token_offset :] = d.token_ids
            lps = d.logprobs if d.logprobs is not None else [None] * len(d.token_ids)
            self.logprobs[d.token_offset :] = lps
        if d.text_offset == len(self.text):
            self._append_text(d.text)
        elif d.text_offset < len(self.text):
            self.text = self.text[: d.text_offset] + d.text
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = d.finish_reason, d.stop_reason, d.error

    def _append_text(self, new: str) -> None:
        """`self.text += new` with the attribute's reference dropped first: the string then has one
        reference, so CPython grows it in place (amortized) instead of copying all the text before
        it for every token, which costs as much as the output is long."""
        if new:
            text, self.text = self.text, ""
            text += new
            self.text = text

    def edge(self) -> Optional[tuple[int, int]]:
        """(tokens, characters) when the client has all there is of the sample and nothing is held
        back or to come: a delta starting there is passed on as it is (`push`). None otherwise."""
        if self.holdback or self.done:
            return None
        tokens, chars = len(self.tokens), len(self.text)
        return (tokens, chars) if tokens == self.sent_tokens and chars == self.sent_chars else None

    def take(self) -> Optional[SampleDelta]:
        """What the client has not seen yet; None when there is nothing new."""
        if self.done:
            return None
        finished = self.finish_reason is not None
        limit = len(self.text) if finished else max(self.sent_chars, len(self.text) - self.holdback)
        new_tokens = self.tokens[self.sent_tokens :]
        new_text = self.text[self.sent_chars : limit]
        if not new_tokens and not new_text and not finished:
            return None
        lps = self.logprobs[self.sent_tokens :]
        delta = SampleDelta(
            index=self.index,
            token_offset=self.sent_tokens,
            token_ids=new_tokens,
            text_offset=self.sent_chars,
            text=new_text,
            logprobs=lps if lps and all(lp is not None for lp in lps) else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens,
        )
        self.sent_tokens = max(self.sent_tokens, len(self.tokens))  # a migration may make sent tokens again
        self.sent_chars = max(self.sent_chars, limit)
        self.done = finished
        return delta

    def push(self, d: SampleDelta) -> Optional[SampleDelta]:
        """`apply(d)` then `take()`. A delta that starts exactly where the client is, with no text
        held back, is what the client gets: passed on as it is (or re-indexed), not rebuilt."""
        at_edge = (
            d.token_offset == len(self.tokens) == self.sent_tokens
            and d.text_offset == len(self.text) == self.sent_chars
        )
        if self.holdback or self.done or not at_edge:
            self.apply(d)
            return self.take()
        self.num_cached_tokens = cached = max(self.num_cached_tokens, d.num_cached_tokens)
        finished = d.finish_reason is not None
        if not d.token_ids and not d.text and not finished:
            return None
        self.tokens += d.token_ids
        self.logprobs += d.logprobs if d.logprobs is not None else [None] * len(d.token_ids)
        self._append_text(d.text)
        self.sent_tokens, self.sent_chars, self.done = len(self.tokens), len(self.text), finished
        if finished:
            self.finish_reason, self.stop_reason, self.error = d.finish_reason, d.stop_reason, d.error
        lps = d.logprobs if d.logprobs and all(lp is not None for lp in d.logprobs) else None
        unchanged = d.index == self.index and cached == d.num_cached_tokens and lps is d.logprobs
        if unchanged and (finished or (d.stop_reason is None and d.error is None)):
            return d
        stop, error = self.stop_reason, self.error
        return SampleDelta(
            self.index, d.token_offset, d.token_ids, d.text_offset, d.text, lps, d.finish_reason, stop, error, cached
        )
