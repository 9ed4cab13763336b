"""What the engine raises when a request cannot go on, and how a finished sample ended.

Each error type says whose fault it is, so the services map it once (`services/common/errors.py`)
and never guess: a client's mistake is never retried and never reported as a server fault.

- `InvalidRequestError`: the request itself cannot be served here (empty or over-long prompt,
  token ids outside the vocabulary, images for an engine that takes none, n > 1 on a stage that
  takes one sample). The client must change it; retrying elsewhere does not help.
- `KVTargetRejected`: a prefill engine refused the decode engine's KV target (layout mismatch,
  expired lease, wrong size). The request is fine; a fresh reservation may succeed.
- `CapacityError`: no room right now (KV blocks, state slots); retry later or elsewhere.
- `TransferError`: moving KV between engines failed (peer unknown or gone, transfer error).

`InvalidRequestError` and `KVTargetRejected` are `ValueError`s and the other two
`RuntimeError`s, so callers that only know the builtin kinds keep working.
"""

from __future__ import annotations

import enum


class EngineError(Exception):
    """Base of the errors a request can end with inside the engine."""


class InvalidRequestError(EngineError, ValueError):
    """The client's request cannot be served as sent (never retried)."""


class KVTargetRejected(EngineError, ValueError):
    """A prefill engine refused a KV target: stale, foreign or the wrong size."""


class CapacityError(EngineError, RuntimeError):
    """Too few free KV blocks or state slots for the request right now."""


class TransferError(EngineError, RuntimeError):
    """A KV transfer between engines failed."""


class FinishReason(str, enum.Enum):
    """How a sample ended; the values are OpenAI's `finish_reason` strings plus the engine's own."""

    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """max_tokens or the context length."""
    ABORT = "abort"
    """The client went away or the request was cancelled."""
    PREEMPTED = "preempted"
    """KV ran out and the engine stops preempted requests (a decode engine always does)."""
    ERROR = "error"
    """The request failed; the sample's `error` says why."""

    def __str__(self) -> str:
        return self.value
