"""Request validation before anything is scheduled: prompts -> token ids, fields -> SamplingParams.

Every refusal is a ServiceError naming the field (`param`), with the HTTP status the gateway
answers: 400 bad values, 404 unknown model, 413 prompt over the context length.
"""

from __future__ import annotations

from typing import Any, Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.errors import ErrorCode, ServiceError

MAX_LOGPROBS = 20


def bad(message: str, param: Optional[str] = None) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_ARGUMENT, message, param)


def check_model(requested: Optional[str], served: str) -> None:
    if requested and requested != served:
        raise ServiceError(
            ErrorCode.NOT_FOUND, f"the model {requested!r} does not exist; this server serves {served!r}", "model"
        )


def build_params(fields: dict[str, Any], max_n: int) -> SamplingParams:
    """SamplingParams from request fields (None = the default, except `max_tokens`: None = up to
    the context length); OpenAI's ranges on top of ours."""
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    n = fields.get("n", 1)
    if not 1 <= n <= max_n:
        raise bad(f"n must be between 1 and {max_n}, got {n}", "n")
    if "temperature" in fields and not 0.0 <= fields["temperature"] <= 2.0:
        raise bad(f"temperature must be between 0 and 2, got {fields['temperature']}", "temperature")
    if fields.get("max_tokens") is not None and fields["max_tokens"] < 1:
        raise bad(f"max_tokens must be at least 1, got {fields['max_tokens']}", "max_tokens")
    lp = fields.get("logprobs")
    if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
        raise bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {lp}", "logprobs")
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        raise bad(str(e), str(e).split(" ", 1)[0]) from None


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
    if params.max_tokens is not None and len(prompt) + params.max_tokens > max_model_len:
        raise bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {len(prompt)} tokens "
            f"and max_tokens asks for {params.max_tokens} more",
            "max_tokens",
        )


def encode_prompts(prompt: Any, tokenizer, vocab_size: int) -> list[list[int]]:
    """A completion prompt (text, texts, token ids, lists of token ids) as token id lists."""
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise bad("prompt must be a non-empty string, list of strings, or list(s) of token ids", "prompt")
    for ids in prompts:
        if any(not 0 <= t < vocab_size for t in ids):
            raise bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return prompts


def encode_chat(messages: list[dict[str, Any]], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of a conversation; image parts become the template's placeholders (their
    images: `media.chat_images`)."""
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise bad(str(e), "messages") from None
