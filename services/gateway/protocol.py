"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

The ranges are `validation`'s (which gRPC requests meet too), written into the models so that the
served `/openapi.json` states them. Fields this server does not implement are declared, so the
schema names them, and refused when set (`http_body`)."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.validation import CHAT_ROLES, FLOAT_RANGES, INT32_MAX, INT_RANGES, MAX_LOGPROBS

_REFUSED = "Not supported: refused (400) when set."


def _int(name: str, default: Any = None) -> Any:
    lo, hi = INT_RANGES[name]
    return Field(default, ge=lo, le=hi)


def _float(name: str, positive: bool = False) -> Any:
    lo, hi = FLOAT_RANGES[name]
    return Field(None, gt=lo, le=hi) if positive else Field(None, ge=lo, le=hi)


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = Field(1, ge=1, description="Samples per prompt, up to the server's --max-n.")
    temperature: Optional[float] = _float("temperature")
    top_p: Optional[float] = _float("top_p", positive=True)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = _float("presence_penalty")
    frequency_penalty: Optional[float] = _float("frequency_penalty")
    seed: Optional[int] = _int("seed")
    logit_bias: Optional[dict[str, float]] = Field(None, description=_REFUSED)
    user: Optional[str] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = _int("top_k")
    min_p: Optional[float] = _float("min_p")
    repetition_penalty: Optional[float] = _float("repetition_penalty", positive=True)
    ignore_eos: bool = False
    min_tokens: int = _int("min_tokens", 0)
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = Field(None, description=_REFUSED)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    """Token ids are checked against the vocabulary by `validation` (a 400 naming `prompt`): a bound
    inside this union would turn into one error per member of it."""
    max_tokens: Optional[int] = _int("max_tokens", 16)
    logprobs: Optional[int] = _int("logprobs")
    echo: bool = Field(False, description=_REFUSED)
    best_of: Optional[int] = Field(None, description="Must equal n when given.")
    suffix: Optional[str] = Field(None, description=_REFUSED)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    """Checked by `validation.check_messages` (a 400 naming the message), for gRPC's roles too."""
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = _int("max_tokens")
    max_completion_tokens: Optional[int] = _int("max_tokens")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Optional[list[dict[str, Any]]] = Field(None, description=_REFUSED)
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(None, description="Only 'none' is served.")
    response_format: Optional[dict[str, Any]] = Field(None, description="Only {'type': 'text'} is served.")
