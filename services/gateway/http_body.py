"""An HTTP request body, from bytes on the wire to a validated request model, refusing on the way
what the server cannot honour: 413 over the size limit (read no further than it), 415 a body that
is not JSON, 400 malformed JSON, strings that are not Unicode and features the server does not
have (tools, structured output), 422 wrong types, 400 values out of range.

`read` runs on the event loop (it only moves bytes); `parse` is CPU work for the tokenizer threads.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from services.common.errors import ErrorCode, ServiceError
from services.gateway import validation

_DRAIN_LIMIT = 64 * 1024 * 1024
"""Bytes of a refused oversized body still read (and dropped) so that the connection stays usable;
past that the connection is closed instead."""

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
"""Pydantic error types that mean a value out of range (400, as the checks of `validation`), not a
wrong type (422)."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only a body with one can hold a lone surrogate."""


def _too_large(size: str, limit: int) -> ServiceError:
    return ServiceError(
        ErrorCode.INVALID_ARGUMENT, f"the request body has {size} bytes; the limit is {limit}", http_status=413
    )


def check_content_type(request: Request) -> None:
    """JSON or nothing said: a form or a text body is refused (415), not guessed at."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            f"the body must be JSON (Content-Type: application/json), not {kind!r}",
            http_status=415,
        )


async def read(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes: never held whole when too large."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        await _drain(request.stream(), int(declared))
        raise _too_large(declared, limit)
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            chunks.clear()
            await _drain(stream)
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(stream, declared: int = 0) -> None:
    if declared > _DRAIN_LIMIT:
        return
    size = 0
    async for chunk in stream:  # each chunk dropped as it comes
        size += len(chunk)
        if size > _DRAIN_LIMIT:
            return


def parse(raw: bytes, model: type[BaseModel], unsupported: dict[str, Any]) -> Any:
    """The request model of a JSON body; `unsupported`: field -> the one value it may have (None:
    leave it out), refused by name otherwise."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise validation.bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise validation.bad("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_strings(data, "")
    refuse_unsupported(data, unsupported)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first["loc"]).lstrip(".")
        status = 400 if first["type"] in _RANGE_ERRORS else 422
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            f"{param}: {first['msg']} ({e.error_count()} error(s))",
            param,
            http_status=status,
        ) from None


def _check_strings(value: Any, where: str) -> None:
    """Every string (keys too) of a parsed body is valid Unicode; the first that is not is named."""
    if isinstance(value, str):
        validation.check_text(value, where or "body")
    elif isinstance(value, dict):
        for key, item in value.items():
            validation.check_text(key, f"{where}.{key}" if where else "a key")
            _check_strings(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


def refuse_unsupported(data: dict[str, Any], unsupported: dict[str, Any]) -> None:
    for name, allowed in unsupported.items():
        value = data.get(name)
        if value is None or value == allowed or (allowed is None and value in ([], {}, "")):
            continue
        raise validation.bad(f"{name} is not supported by this server (got {json.dumps(value)[:80]})", name)


_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
"""vLLM's structured-output fields: no grammar-constrained sampler serves them here."""

COMPLETION_UNSUPPORTED: dict[str, Any] = {
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "prompt_logprobs": None,
    "response_format": {"type": "text"},
    **{name: None for name in _STRUCTURED},
}
CHAT_UNSUPPORTED: dict[str, Any] = {
    "tools": None,
    "functions": None,
    "tool_choice": "none",
    "function_call": "none",
    "response_format": {"type": "text"},
    "logit_bias": None,
    "prompt_logprobs": None,
    **{name: None for name in _STRUCTURED},
}
"""Fields of OpenAI's (and vLLM's) API that this server does not implement, with the one value that
asks for nothing; any other is refused by name rather than silently ignored: a client asking for a
tool call or for JSON output would otherwise get neither, and no error."""
