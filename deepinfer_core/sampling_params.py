"""Per-request sampling parameters, with vLLM's field names and semantics.

Clients of the OpenAI-compatible API already know vLLM's names, so we keep them
(and their meaning) instead of inventing our own. Everything is validated once,
on construction, so the sampler and the stop checker can trust the values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

GREEDY_EPS = 1e-5
"""Temperatures below this mean greedy decoding (as in vLLM)."""


@dataclass
class SamplingParams:
    """How to pick each output token of one request and when to stop."""

    n: int = 1
    """Number of output sequences to return for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; below `GREEDY_EPS` means greedy (argmax), ignoring top_p/top_k/min_p."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 (or -1 on input) disables it."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output."""
    repetition_penalty: float = 1.0
    """HF-style: logits of tokens in prompt or output are divided (if > 0) or multiplied (if < 0) by it."""
    seed: Optional[int] = None
    """Seed of the request's own RNG; the same seed gives the same tokens whatever the batch."""
    stop: Optional[Union[str, list[str]]] = None
    """Strings that end generation; normalised to a list."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end generation (the token is kept in the output ids); normalised to a list."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: Optional[int] = 16
    """Most output tokens to generate; None means up to the context length (the engine resolves it)."""
    min_tokens: int = 0
    """Output tokens to generate before EOS, stop token ids or stop strings may end the request."""
    logprobs: Optional[int] = None
    """Top logprobs to return per output token; 0 returns only the sampled token's."""
    prompt_logprobs: Optional[int] = None
    """Top logprobs to return per prompt token; 0 returns only the prompt token's."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    detokenize: bool = True
    """Produce output text (stop strings need it)."""

    def __post_init__(self) -> None:
        self._normalise()
        self._verify()
        if self.is_greedy:
            # With greedy decoding these filters cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax instead of drawing a token."""
        return self.temperature < GREEDY_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (e.g. for the n > 1 children of one request). Every field is a scalar but the
        two lists, so they alone are copied: `copy.deepcopy` took longer than routing the request."""
        p = copy.copy(self)
        if isinstance(p.stop, list):
            p.stop = list(p.stop)
        if p.stop_token_ids is not None:
            p.stop_token_ids = list(p.stop_token_ids)
        return p

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    def _verify(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _require(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "top_k", self.top_k, "must be >= 1, or 0 / -1 to disable")
        _require(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must be <= max_tokens={self.max_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(value >= 0, name, value, "must be >= 0")
        for s in self.stop:
            _require(isinstance(s, str) and len(s) > 0, "stop", self.stop, "must contain only non-empty strings")
        for t in self.stop_token_ids:
            _require(
                isinstance(t, int) and t >= 0,
                "stop_token_ids",
                self.stop_token_ids,
                "must contain only integers >= 0",
            )


def _require(ok: bool, field_name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {rule}, got {value!r}")
