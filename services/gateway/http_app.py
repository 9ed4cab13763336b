"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) over GatewayCore.

Bodies are parsed here, not by FastAPI, so that each failure gets its own status and an
OpenAI-style error body: 400 malformed JSON or bad values, 401 missing/wrong API key,
404 unknown model, 413 body too large or prompt over the context length, 422 wrong types,
429 too many requests in flight, 503/504 when a stage fails or the deadline passes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import ErrorCode, ServiceError
from services.gateway import validation
from services.gateway.core import Choice, GatewayCore, usage
from services.gateway.event_streams import chat_events, completion_events
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import Formatter, error_body, service_error_body

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


def build_app(core: GatewayCore, on_metrics=None, metrics_registry=None) -> FastAPI:
    """`on_metrics`: an async callable run before each /metrics scrape; `metrics_registry`: what
    /metrics serves (default: this process's registry; with several API processes, all of theirs)."""
    app = FastAPI(title="DeepInfer Cluster", docs_url=None, redoc_url=None)
    app.state.core = core
    _add_error_handlers(app)
    _add_info_routes(app, core, on_metrics, metrics_registry or REGISTRY)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(request, core)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _chat_completions(request, core)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, e: ServiceError):
        headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s is not None else None
        return JSONResponse(service_error_body(e), status_code=e.http_status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)


def _add_info_routes(app: FastAPI, core: GatewayCore, on_metrics, metrics_registry) -> None:
    @app.get("/health")
    async def health():
        ready, detail = await core.ready()
        return JSONResponse(
            {"status": "ok" if ready else "starting", "detail": detail}, status_code=200 if ready else 503
        )

    @app.get("/metrics")
    async def metrics():
        if on_metrics is not None:
            await on_metrics()
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        core.check_api_key(request.headers.get("authorization"))
        model = {
            "id": core.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "deepinfer",
            "max_model_len": core.config.max_model_len,
        }
        return {"object": "list", "data": [model]}


async def _completions(request: Request, core: GatewayCore):
    body = await _parse(request, core, CompletionRequest)
    for name, unsupported in (("echo", body.echo), ("suffix", body.suffix), ("logit_bias", body.logit_bias)):
        if unsupported:
            raise validation.bad(f"{name} is not supported", name)
    if body.best_of is not None and body.best_of != body.n:
        raise validation.bad("best_of must equal n (or be left out)", "best_of")
    prompts = validation.encode_prompts(body.prompt, core.tokenizer, core.vocab_size)
    params = core.prepare(prompts, _sampling_fields(body, logprobs=body.logprobs))
    fmt = Formatter(core.tokenizer, f"cmpl-{uuid.uuid4().hex}", core.config.model_name, body.logprobs)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, core, prompts, params, fmt, body.stream, include_usage, chat=False)


async def _chat_completions(request: Request, core: GatewayCore):
    body = await _parse(request, core, ChatCompletionRequest)
    if body.logit_bias:
        raise validation.bad("logit_bias is not supported", "logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise validation.bad("top_logprobs needs logprobs=true", "top_logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt = validation.encode_chat(messages, core.tokenizer, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = core.prepare([prompt], _sampling_fields(body, logprobs=top, max_tokens=max_tokens), "messages")
    fmt = Formatter(core.tokenizer, f"chatcmpl-{uuid.uuid4().hex}", core.config.model_name, top)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, core, [prompt], params, fmt, body.stream, include_usage, chat=True)


async def _parse(request: Request, core: GatewayCore, model: type[BaseModel]) -> Any:
    core.check_api_key(request.headers.get("authorization"))
    raw = await request.body()
    if len(raw) > core.config.max_request_bytes:
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT,
            f"the request body has {len(raw)} bytes; the limit is {core.config.max_request_bytes}",
            http_status=413,
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise validation.bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise validation.bad("the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"])
        raise ServiceError(
            ErrorCode.INVALID_ARGUMENT, f"{param}: {first['msg']} ({e.error_count()} error(s))", param, http_status=422
        ) from None
    validation.check_model(body.model, core.config.model_name)
    return body


def _sampling_fields(body, logprobs, max_tokens=None) -> dict[str, Any]:
    fields = {
        name: getattr(body, name)
        for name in (
            "n",
            "temperature",
            "top_p",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "top_k",
            "min_p",
            "repetition_penalty",
            "ignore_eos",
            "min_tokens",
            "stop_token_ids",
            "skip_special_tokens",
            "include_stop_str_in_output",
        )
    }
    fields["logprobs"] = logprobs
    fields["max_tokens"] = max_tokens if max_tokens is not None else getattr(body, "max_tokens", None)
    return fields


async def _respond(request, core, prompts, params, fmt, stream, include_usage, chat):
    if stream:
        core.admit()  # counted in now (429 while a status can still say so); `_AdmittedStream` lets go
        events = (chat_events if chat else completion_events)(core, prompts, params, fmt, include_usage)
        return _AdmittedStream(core, events)
    core.admit()
    try:
        choices = await _until_disconnect(request, _collect(core, prompts, params, fmt.id))
    finally:
        core.release()
    body = (fmt.chat if chat else fmt.completion)(choices, usage(choices))
    return JSONResponse(body)


async def _collect(core, prompts, params, request_id) -> list[Choice]:
    choices: dict[int, Choice] = {}
    async for choice, _ in core.generate(prompts, params, request_id):
        choices[choice.index] = choice
    return list(choices.values())


async def _until_disconnect(request: Request, coro):
    """Run `coro`; if the client goes away first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ServiceError(ErrorCode.CANCELLED, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()


class _AdmittedStream(StreamingResponse):
    """An SSE stream admitted before it starts: it lets go of its place once the response is over,
    whether the stream ran to its end, failed, or never started (the client left before it did)."""

    def __init__(self, core: GatewayCore, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream")
        self._core = core

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._core.release()
