"""The OpenAI wire format: request bodies for both endpoints and what each streamed chunk says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from services.bench.records import BenchRequest

COMPLETIONS, CHAT = "completions", "chat"


def endpoint_kind(endpoint: str) -> str:
    """COMPLETIONS or CHAT, from the endpoint's path."""
    path = endpoint.rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    raise ValueError(f"--endpoint {endpoint}: expected a path ending in /completions or /chat/completions")


@dataclass(frozen=True)
class Sampling:
    """Sampling fields sent with every request; None leaves the server's default."""

    temperature: Optional[float] = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    ignore_eos: bool = False
    """vLLM's extension (this gateway has it too): generate max_tokens whatever the model samples."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Merged into each body last (--extra-body JSON)."""


def request_body(kind: str, model: str, request: BenchRequest, sampling: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if kind == CHAT:
        if isinstance(request.prompt, list):
            raise ValueError("the chat endpoint takes text prompts: drop --prompt-format token-ids")
        body["messages"] = [{"role": "user", "content": _chat_content(request)}]
        body["max_completion_tokens"] = request.output_len
    else:
        if request.images:
            raise ValueError("image requests need the chat endpoint: --endpoint /v1/chat/completions")
        body["prompt"] = request.prompt
        body["max_tokens"] = request.output_len
    for name in ("temperature", "top_p", "top_k"):
        if getattr(sampling, name) is not None:
            body[name] = getattr(sampling, name)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    body.update(sampling.extra_body)
    return body


def _chat_content(request: BenchRequest) -> str | list[dict[str, Any]]:
    if not request.images:
        return request.prompt
    parts: list[dict[str, Any]] = [{"type": "text", "text": request.prompt}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
    return parts


@dataclass
class Chunk:
    """What one `data:` event of the stream carried."""

    text: Optional[str] = None
    """Generated text when the event carried a token (possibly "" on completions), else None."""
    usage: Optional[dict[str, Any]] = None
    error: Optional[str] = None


def parse_event(kind: str, data: str) -> Chunk:
    """One SSE `data:` payload (not `[DONE]`)."""
    try:
        event = json.loads(data)
    except ValueError:
        return Chunk(error=f"the stream sent an event that is not JSON: {data[:200]!r}")
    if not isinstance(event, dict):
        return Chunk(error=f"the stream sent an event that is not a JSON object: {data[:200]!r}")
    if event.get("error"):
        return Chunk(error=f"the server ended the stream with an error: {error_message(event)}")
    chunk = Chunk(usage=event.get("usage") or None)
    choices = event.get("choices") or []
    if choices:
        chunk.text = _token_text(kind, choices[0])
    return chunk


def _token_text(kind: str, choice: dict[str, Any]) -> Optional[str]:
    # A completions chunk is one step of tokens even when its text is "" (a token ending inside a
    # UTF-8 character). On chat, the role-only chunk and empty deltas carry no token, so they are not
    # timed: counting them would put a near-zero gap into the inter-token latencies.
    if kind == COMPLETIONS:
        return choice.get("text")
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or None


def error_message(body: Any) -> str:
    """The message of an OpenAI-style error body, or the body itself, shortened."""
    if isinstance(body, (bytes, str)):
        raw = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(raw)
        except ValueError:
            return raw.strip()[:300] or "(empty body)"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    if isinstance(error, str):
        return error[:300]
    detail = body.get("detail") if isinstance(body, dict) else None
    return str(detail or body)[:300]
