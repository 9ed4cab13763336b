"""The two values every stage of a run passes along: what to send, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class BenchRequest:
    """One request of a dataset, independent of the endpoint it will be sent to."""

    prompt: Union[str, list[int]]
    """Text, or token ids (the completions endpoint only)."""
    prompt_len: int
    """Prompt tokens as the dataset counted them; the server's `usage` replaces it when given."""
    output_len: int
    """max_tokens of the request."""
    images: list[str] = field(default_factory=list)
    """Data URLs (`data:image/png;base64,...`) sent as image parts of a chat message."""


@dataclass
class RequestRecord:
    """What one request measured. Times are `time.perf_counter()` seconds."""

    prompt_len: int
    """Prompt tokens: the server's `usage.prompt_tokens` when it gave one, else the dataset's count."""
    start: float = 0.0
    """When the request was sent."""
    end: float = 0.0
    """When its stream ended (or it failed)."""
    ttft: float = 0.0
    """Seconds from sending to the first chunk that carried generated text."""
    itl: list[float] = field(default_factory=list)
    """Seconds between successive text chunks after the first: the first token is never in here."""
    output_tokens: int = 0
    """From the server's `usage.completion_tokens` when the stream gave it, else the text chunks counted."""
    success: bool = False
    error: str = ""
    """Why it failed ("" on success): HTTP status and the server's message, or the client's exception."""
    generated_text: str = ""

    @property
    def latency(self) -> float:
        """End-to-end seconds, sending to the end of the stream."""
        return self.end - self.start

    @property
    def tpot(self) -> Optional[float]:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)
