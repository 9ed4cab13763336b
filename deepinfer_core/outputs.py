"""Results handed to callers, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    """Which of the request's n samples."""
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, float]]] = None
    """Per output token: token id -> logprob (the sampled token plus the top-k asked for)."""
    finish_reason: Optional[str] = None
    """A `FinishReason` (a str: 'stop', 'length', 'abort', 'preempted' or 'error'); None while running."""
    stop_reason: Optional[int | str] = None
    """The stop token id or stop string that ended the sample."""
    error: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
