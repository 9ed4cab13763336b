"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) over GatewayCore.

Bodies are parsed by `http_body`, not by FastAPI, so that each failure gets its own status and an
OpenAI-style error body: 400 malformed JSON, bad values or an unsupported feature, 401 missing/wrong
API key, 404 unknown model or route, 405 wrong method (with `Allow`), 413 body too large or prompt
over the context length, 415 a body that is not JSON, 422 wrong types, 429 no room now (with
`Retry-After`), 503/504 when a stage fails or the deadline passes. A 500 is a fault of the server
alone, and is answered on a connection that stays open.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import ServiceError
from services.common.grpc_util import whole_seconds
from services.gateway import http_body, openapi, validation
from services.gateway.client_watch import ClientWatch
from services.gateway.core import INLINE_BODY_BYTES, Choice, GatewayCore, usage
from services.gateway.event_response import EventStream, EventStreamApp
from services.gateway.event_streams import chat_events, completion_events
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import Formatter, error_body, service_error_body
from services.gateway.sse_lane import SseLane

logger = logging.getLogger(__name__)


def build_app(core: GatewayCore, on_metrics=None, metrics_registry=None) -> FastAPI:
    """`on_metrics`: an async callable run before each /metrics scrape; `metrics_registry`: what
    /metrics serves (default: this process's registry; with several API processes, all of theirs)."""
    app = EventStreamApp(title="DeepInfer Cluster", docs_url=None, redoc_url=None)
    app.state.core = core
    _add_error_handlers(app)
    _add_info_routes(app, core, on_metrics, metrics_registry or REGISTRY)

    @app.post("/v1/completions", **openapi.route(CompletionRequest))
    async def completions(request: Request):
        return await _completions(request, core)

    @app.post("/v1/chat/completions", **openapi.route(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _chat_completions(request, core)

    # the two routes every token-serving request takes, past FastAPI's layers (registered above all
    # the same: OpenAPI, and 405 for another method, are FastAPI's)
    app.direct[("POST", "/v1/completions")] = _direct(_completions, core)
    app.direct[("POST", "/v1/chat/completions")] = _direct(_chat_completions, core)
    openapi.install(app, [CompletionRequest, ChatCompletionRequest])
    return app


def _direct(endpoint, core: GatewayCore):
    """`endpoint` as a direct route (`EventStreamApp.direct`): a refusal or a bug before the response
    starts is answered as the app's handlers and `_ServerFaults` answer it."""

    async def app(scope, receive, send) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request, core)
        except ServiceError as e:
            response = _service_error_response(e)
        except Exception as e:
            logger.exception("unexpected error on %s", scope.get("path"))
            response = JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)
        await response(scope, receive, send)

    return app


def _service_error_response(e: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(whole_seconds(e.retry_after_s))} if e.retry_after_s is not None else None
    return JSONResponse(service_error_body(e), status_code=e.http_status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, e: ServiceError):
        return _service_error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = str(e.detail)
        if e.status_code == 405:  # e.headers carries its `Allow`
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {e.headers['Allow']}"
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    app.add_middleware(_ServerFaults)


class _ServerFaults:
    """A bug's exception as a 500 body, on a connection that stays open. (Starlette's handler for
    `Exception` answers and then raises again, and uvicorn closes the connection on the raise.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            logger.exception("unexpected error on %s", scope.get("path"))
            if started:  # a response already under way cannot be turned into an error
                raise
            body = error_body(500, f"internal error: {type(e).__name__}: {e}")
            await JSONResponse(body, status_code=500)(scope, receive, send)


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
    body = await _parse(request, core, CompletionRequest, http_body.COMPLETION_UNSUPPORTED)
    if body.best_of is not None and body.best_of != body.n:
        raise validation.bad("best_of must equal n (or be left out)", "best_of")
    prompts = await core.encode_prompts(body.prompt)
    params = core.prepare(prompts, _sampling_fields(body, logprobs=body.logprobs))
    fmt = Formatter(core.tokenizer, f"cmpl-{uuid.uuid4().hex}", core.config.model_name, body.logprobs)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, core, prompts, params, fmt, body.stream, include_usage, chat=False)


async def _chat_completions(request: Request, core: GatewayCore):
    body = await _parse(request, core, ChatCompletionRequest, http_body.CHAT_UNSUPPORTED)
    if body.top_logprobs is not None and not body.logprobs:
        raise validation.bad("top_logprobs needs logprobs=true", "top_logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt, images = await core.encode_chat(messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = core.prepare([prompt], _sampling_fields(body, logprobs=top, max_tokens=max_tokens), "messages")
    fmt = Formatter(core.tokenizer, f"chatcmpl-{uuid.uuid4().hex}", core.config.model_name, top)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, core, [prompt], params, fmt, body.stream, include_usage, chat=True, images=images)


async def _parse(request: Request, core: GatewayCore, model: type[BaseModel], unsupported: dict[str, Any]) -> Any:
    core.check_api_key(request.headers.get("authorization"))
    http_body.check_content_type(request)
    raw = await http_body.read(request, core.config.max_request_bytes)
    body = await core.offload(http_body.parse, raw, model, unsupported, small=len(raw) <= INLINE_BODY_BYTES)
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


async def _respond(request, core, prompts, params, fmt, stream, include_usage, chat, images=()):
    # counted in now, while a status can still say 429; a stream lets go when its response is over
    work = core.admit(prompts, params)
    watch = ClientWatch(request.receive)
    if stream:
        lane = SseLane.for_request(prompts, params)  # None: the request's every delta takes the chain
        try:  # the headers wait for the first delta: a refusal before it is a status (429/503, Retry-After)
            deltas = await _started(watch, core.generate(prompts, params, fmt.id, images, lane=lane))
        except BaseException:
            watch.stop()
            core.release(work)
            raise
        if chat:
            events = chat_events(core, prompts, params, fmt, include_usage, images, deltas=deltas, lane=lane)
        else:
            events = completion_events(core, prompts, params, fmt, include_usage, deltas=deltas, lane=lane)
        return EventStream(events, on_end=lambda: core.release(work), lane=lane, watch=watch)
    try:
        choices = await watch.until_gone(_collect(core, prompts, params, fmt.id, images))
    finally:
        watch.stop()
        core.release(work)
    body = (fmt.chat if chat else fmt.completion)(choices, usage(choices))
    return JSONResponse(body)


async def _collect(core, prompts, params, request_id, images=()) -> list[Choice]:
    choices: dict[int, Choice] = {}
    async for choice, _ in core.generate(prompts, params, request_id, images):
        choices[choice.index] = choice
    return list(choices.values())


async def _started(watch: ClientWatch, deltas: AsyncIterator) -> AsyncIterator:
    """`deltas` with its first item already read (raises what it raised before any): a stream
    refused before its first byte (no room, a pool empty, the deadline) is answered with a status
    and `Retry-After`, not a 200 whose only event is the error."""
    try:
        first = await watch.until_gone(deltas.__anext__())
    except StopAsyncIteration:
        return deltas
    except BaseException:
        await deltas.aclose()
        raise
    return _after(first, deltas)


async def _after(first, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
