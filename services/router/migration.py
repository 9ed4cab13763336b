"""Request migration: a sample whose decode stream broke mid-request continues on another engine.

The router has seen every token the client has (`SampleProgress`), so a healthy PE/CE pair (or
NORMAL engine) is asked for the rest: prompt + tokens so far as the new prompt, `max_tokens` and
`min_tokens` lowered by what was generated. Its deltas are shifted past what the client has, so the
stream goes on without a repeated or a dropped token (from the last point where the text so far is
the whole decoding of the tokens so far: see `continuation`).

What holds: greedy decoding continues token-identical to an undisturbed run (the next token is a
function of the tokens so far). Seeded sampling stays reproducible for a given migration point but
is not the undisturbed run's continuation: the new engine's generator starts from the seed at the
first continued token, and frequency/presence penalties now count the earlier output as prompt. A
stop string that would span the break is not seen by the new engine (its output text starts there).
Workers with a stream interval over 1 (`--stream-interval`) send one-token deltas only at a sample's
first token, so a migration there starts after the first token and makes the rest again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError

BROKEN_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.CANCELLED})
"""Stream errors that mean the decode engine (or the way to it) failed, not the request. CANCELLED
too: the router's own cancellation (the client left) never comes as an error, so a cancelled call
is one whose channel closed under it (the worker left the registry) or one the worker ended."""
BROKEN_FINISHES = frozenset({"error", "abort", "preempted"})
"""Finish reasons a decode engine ends a stream with when it, not the request, failed (the router's
own aborts are never read back: it stops reading first)."""


class StreamBroken(Exception):
    """The decode stream of a sample ended without finishing it."""

    def __init__(self, reason: str, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE):
        super().__init__(message)
        self.reason = reason
        """The `migrations_total` label: the error code or finish reason, lower case."""
        self.message = message
        self.code = code

    def as_error(self, migrations: int) -> ServiceError:
        tried = f" after {migrations} migration(s)" if migrations else ""
        return ServiceError(self.code, f"{self.message}{tried}")

    @classmethod
    def from_error(cls, e: ServiceError) -> Optional[StreamBroken]:
        return cls(e.code.name.lower(), e.message, e.code) if e.code in BROKEN_CODES else None

    @classmethod
    def from_delta(cls, d: SampleDelta) -> Optional[StreamBroken]:
        if d.finish_reason not in BROKEN_FINISHES:
            return None
        return cls(d.finish_reason, f"the decode engine ended the stream: {d.error or d.finish_reason}")


class SampleProgress:
    """What the client has of one sample, and how a continuation's deltas are placed after it."""

    def __init__(self, prompt: list[int], params: SamplingParams):
        self.prompt = prompt
        self.params = params
        self._tokens: list[int] = []
        """The sample's tokens the client has (a continuation's prompt ends with some of them)."""
        self._num_chars = 0
        """The length of the sample's text the client has: the text itself is not needed here."""
        self._base_tokens = 0
        self._base_chars = 0
        """Where the current attempt's output starts in the sample's."""
        self._clean = (0, 0)
        """(tokens, characters) after the last one-token delta whose text ended on a whole character:
        there the text so far is the decoding of the tokens so far, nothing held back."""

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def edge(self) -> tuple[int, int, int, int]:
        """(tokens, characters) the client has of the sample, and where the current attempt's
        output starts in them (a native lane takes deltas from there: `fast_lane.py`)."""
        return len(self._tokens), self._num_chars, self._base_tokens, self._base_chars

    def mark_clean(self, tokens: int, chars: int) -> None:
        """A clean point `place` would have recorded for a one-token delta taken elsewhere."""
        self._clean = (tokens, chars)

    def place(self, d: SampleDelta) -> SampleDelta:
        """The current attempt's delta as a delta of the whole sample (recorded as seen)."""
        if self._base_tokens or self._base_chars:
            d = dataclasses.replace(
                d, token_offset=d.token_offset + self._base_tokens, text_offset=d.text_offset + self._base_chars
            )
        if d.token_offset <= len(self._tokens):  # as `SampleAssembler.apply` splices them
            self._tokens[d.token_offset :] = d.token_ids
        if d.text_offset <= self._num_chars:
            self._num_chars = d.text_offset + len(d.text)
        if len(d.token_ids) == 1 and d.text and not d.text.endswith("\ufffd"):
            self._clean = (len(self._tokens), self._num_chars)
        return d

    def strip_failure(self, d: SampleDelta) -> Optional[SampleDelta]:
        """A failed final delta without its failure: the tokens it carries still count (None: none)."""
        if not d.token_ids and not d.text:
            return None
        return dataclasses.replace(d, finish_reason=None, stop_reason=None, error=None)

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """The prompt and parameters that produce the rest of the sample; later deltas are placed
        after what has been seen.

        It starts from the last clean point, not the last token: a token whose bytes do not end a
        character (its text held back, or part of a run of invalid bytes) would decode differently
        as the end of a prompt than inside the output. Tokens past that point are made again
        (under greedy decoding the same ones; the client is sent none twice, only what is new)."""
        n, chars = self._clean
        self._base_tokens, self._base_chars = n, chars
        if n == 0:
            return self.prompt, self.params
        p = self.params.clone()
        if p.max_tokens is not None:
            p.max_tokens = max(1, p.max_tokens - n)
        p.min_tokens = max(0, p.min_tokens - n)
        p.prompt_logprobs = None  # reported once, by the first attempt
        return self.prompt + self._tokens[:n], p
