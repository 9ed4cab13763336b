"""The served `/openapi.json`: request bodies from the request models and every error response,
so that outside tools (clients' generators, schemathesis) can test the API against it.

The routes read their bodies themselves (`http_body`: each failure its own status), so FastAPI
does not see the models; `route()` declares them on each route and `install()` adds their schemas."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    """invalid_request_error, authentication_error, rate_limit_error, server_error"""
    param: Optional[str] = None
    """The request field at fault, when one is."""
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


_ERRORS = {
    400: "Malformed JSON, a value out of range, an unknown role or an unsupported feature (named in `param`)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Body over the size limit, or prompt over the context length",
    415: "A body that is not JSON",
    422: "A field of the wrong type",
    429: "No room now; `Retry-After` says when to retry",
    500: "A fault of the server",
    503: "A stage is unavailable",
    504: "The request's deadline passed",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def route(model: type[BaseModel]) -> dict[str, Any]:
    """The keyword arguments of a POST route whose body is `model`."""
    responses: dict[int | str, Any] = {
        status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()
    }
    responses[429]["headers"] = _RETRY_AFTER
    responses[200] = {
        "description": "The answer; a stream of server-sent events when `stream` is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    body = {"required": True, "content": {"application/json": {"schema": _ref(model.__name__)}}}
    return {"responses": responses, "openapi_extra": {"requestBody": body}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """`app.openapi()` (what `/openapi.json` serves) with the schemas of `models` in its components."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[model.__name__] = s
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema
