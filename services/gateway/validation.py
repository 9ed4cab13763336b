"""Request validation before anything is scheduled: prompts -> token ids, fields -> SamplingParams.

Every refusal is a ServiceError naming the field (`param`), with the HTTP status the gateway
answers: 400 bad values, 404 unknown model, 413 prompt over the context length. Both front doors
(HTTP and gRPC) call these, so a value is refused the same way whichever way it came.
"""

from __future__ import annotations

from typing import Any, Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.errors import ErrorCode, ServiceError
from services.gateway.media import IMAGE_PARTS

MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

INT_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (-1, INT32_MAX),
    "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "logprobs": (0, MAX_LOGPROBS),
}
"""Integer fields and the values they may take: the OpenAI ranges where there are some, else the
widest the internal messages carry (int32/int64 proto fields): a larger value would only fail
later, inside the gateway, as a server error."""

FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 1e6),
}
"""Float fields and their closed ranges (SamplingParams adds top_p > 0 and repetition_penalty > 0)."""

CHAT_ROLES = ("system", "user", "assistant")
"""Roles a conversation may use: a tool or function turn needs tool calls, which are not served."""

_TOOL_KEYS = ("tool_calls", "tool_call_id", "function_call")
"""Keys of a message that only make sense with tools."""

HEAD_CHARS_PER_TOKEN = 32
"""A text longer than the context length times this has its head tokenized first (see
`refuse_surely_long`): tokens average a few characters, so a head this long that is not yet over the
context is rare, and the whole text is then tokenized as usual."""
_EDGE_TOKENS = 16
"""Tokens that cutting a text may add at the cut (a word split in two)."""


def bad(message: str, param: Optional[str] = None) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_ARGUMENT, message, param)


def check_model(requested: Optional[str], served: str) -> None:
    if requested and requested != served:
        raise ServiceError(
            ErrorCode.NOT_FOUND, f"the model {requested!r} does not exist; this server serves {served!r}", "model"
        )


def build_params(fields: dict[str, Any], max_n: int, vocab_size: int) -> SamplingParams:
    """SamplingParams from request fields (None = the default, except `max_tokens`: None = up to
    the context length); OpenAI's ranges and the internal messages' on top of ours."""
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    if "prompt_logprobs" in fields:
        raise bad(
            "prompt_logprobs is not supported: the server returns no logprobs of prompt tokens", "prompt_logprobs"
        )
    n = fields.get("n", 1)
    if not 1 <= n <= max_n:
        raise bad(f"n must be between 1 and {max_n}, got {n}", "n")
    _check_ranges(fields)
    stop_ids = fields.get("stop_token_ids") or []
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise bad(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    stops = fields.get("stop")
    for s in [stops] if isinstance(stops, str) else stops or []:
        check_text(s, "stop")
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        raise bad(str(e), str(e).split(" ", 1)[0]) from None


def _check_ranges(fields: dict[str, Any]) -> None:
    for name, (lo, hi) in INT_RANGES.items():
        value = fields.get(name)
        if value is not None and not lo <= value <= hi:
            raise bad(f"{name} must be between {lo} and {hi}, got {value}", name)
    for name, (lo, hi) in FLOAT_RANGES.items():
        value = fields.get(name)
        if value is not None and not lo <= value <= hi:  # NaN compares false: refused too
            raise bad(f"{name} must be between {lo:g} and {hi:g}, got {value}", name)


def check_text(text: str, param: str) -> None:
    """A string that cannot be written as UTF-8 (a lone surrogate such as "\\ud800", which JSON can
    spell) is the client's mistake, not a fault of the tokenizer that would choke on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None


def check_length(prompt: list[int], params: SamplingParams, max_model_len: int, param: str = "prompt") -> None:
    if not prompt:
        raise bad("the prompt is empty", param)
    if len(prompt) >= max_model_len:
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {len(prompt)} tokens",
            param,
            http_status=413,
        )
    if len(prompt) + params.min_tokens > max_model_len:
        raise bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {len(prompt)} tokens "
            f"and min_tokens asks for {params.min_tokens} more",
            "min_tokens",
        )
    if params.max_tokens is not None and len(prompt) + params.max_tokens > max_model_len:
        raise bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {len(prompt)} tokens "
            f"and max_tokens asks for {params.max_tokens} more",
            "max_tokens",
        )


def encode_prompts(prompt: Any, tokenizer, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """A completion prompt (text, texts, token ids, lists of token ids) as token id lists."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [_checked_ids(prompt, vocab_size)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_checked_ids(p, vocab_size) for p in prompt]
    else:
        raise bad("prompt must be a non-empty string, list of strings, or list(s) of token ids", "prompt")
    for text in texts:
        check_text(text, "prompt")
        refuse_surely_long(text, tokenizer, max_model_len, "prompt")
    return tokenizer.encode_batch(texts)


def _checked_ids(ids: list, vocab_size: int) -> list[int]:
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return list(ids)


def refuse_surely_long(text: str, tokenizer, max_model_len: int, param: str) -> None:
    """413 for a text whose head alone is over the context length, without tokenizing the rest:
    a huge prompt costs the tokenizer time (seconds for megabytes) and memory that no answer needs.
    Tokens of a text cut in two are those of each part, give or take the word at the cut."""
    head = max_model_len * HEAD_CHARS_PER_TOKEN
    if len(text) <= head:
        return
    count = len(tokenizer.encode(text[:head], add_special_tokens=False))
    if count > max_model_len + _EDGE_TOKENS:
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has more than "
            f"{count - _EDGE_TOKENS} tokens ({len(text)} characters)",
            param,
            http_status=413,
        )


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Roles from CHAT_ROLES, content text and image parts: anything else is named and refused (a
    tool turn would reach no tool parser, an unknown part type no template)."""
    if not messages:
        raise bad("messages must be a non-empty list of {'role', 'content'} messages", "messages")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(
                f"messages[{i}].role is {role!r}: it must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role"
            )
        for key in _TOOL_KEYS:
            if message.get(key):
                raise bad(f"messages[{i}].{key}: tool calls are not supported", f"messages[{i}].{key}")
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            _check_part(part, f"messages[{i}].content[{j}]")


def _check_part(part: Any, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in IMAGE_PARTS:  # its image is checked apart (`media.chat_images`), on a thread pool
        return
    if kind != "text" or not isinstance(part.get("text"), str):
        raise bad(f"{where} must be a {{'type': 'text', 'text': ...}} part, got type {kind!r}", where)
    check_text(part["text"], where)


def encode_chat(
    messages: list[dict[str, Any]], tokenizer, max_model_len: int, add_generation_prompt: bool = True
) -> list[int]:
    """Prompt ids of a conversation; image parts become the template's placeholders (their
    images: `media.chat_images`)."""
    check_messages(messages)
    texts = [m["content"] if isinstance(m.get("content"), str) else "" for m in messages]
    texts += [p["text"] for m in messages if isinstance(m.get("content"), list) for p in m["content"] if "text" in p]
    # one line each, as templates write them: no word of one message merges with the next's
    refuse_surely_long("\n".join(texts), tokenizer, max_model_len, "messages")
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise bad(str(e), "messages") from None
