"""OpenAI response bodies, logprob layouts and the stream's usage chunk, built from `Choice`s
(the stream's per-token chunks are `chunks.py`'s)."""

from __future__ import annotations

import time
from typing import Any, Optional

from services.common.deltas import TokenLogprob
from services.common.errors import ServiceError
from services.gateway.core import Choice

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "context_length_exceeded"}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code or _ERROR_CODES.get(status),
        }
    }


def service_error_body(e: ServiceError) -> dict[str, Any]:
    return error_body(e.http_status, e.message, e.param)


def finish_reason(choice_or_delta) -> Optional[str]:
    return choice_or_delta.finish_reason


class Formatter:
    """Token strings and logprob layouts, for one request."""

    def __init__(self, tokenizer, request_id: str, model: str, top_logprobs: Optional[int]):
        self.tokenizer = tokenizer
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        """How many alternatives to list per token; None = no logprobs."""
        self._tokens: dict[int, str] = {}
        """Token id -> its text, decoded once per request (each listed token and alternative)."""

    def token(self, token_id: int) -> str:
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _top(self, lp: TokenLogprob) -> list[tuple[int, float]]:
        ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])
        return ranked[: self.top_logprobs or 0]

    # ---- /v1/completions ---------------------------------------------------------------------
    def completion_logprobs(self, lps: list[TokenLogprob], text_offset: int) -> Optional[dict[str, Any]]:
        if self.top_logprobs is None:
            return None
        tokens = [self.token(lp.token_id) for lp in lps]
        offsets, pos = [], text_offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token(t): v for t, v in self._top(lp)} for lp in lps],
            "text_offset": offsets,
        }

    def completion(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self.completion_logprobs(c.logprobs, 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in sorted(choices, key=lambda c: c.index)
            ],
            "usage": usage,
        }

    # ---- /v1/chat/completions ------------------------------------------------------------------
    def chat_logprobs(self, lps: list[TokenLogprob]) -> Optional[dict[str, Any]]:
        if self.top_logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            s = self.token(token_id)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in self._top(lp)]}
                for lp in lps
            ]
        }

    def chat(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in sorted(choices, key=lambda c: c.index)
            ],
            "usage": usage,
        }

    def usage_chunk(self, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
