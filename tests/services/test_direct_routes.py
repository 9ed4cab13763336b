"""The two completion routes are served past FastAPI's layers (`EventStreamApp.direct`): their
answers, refusals included, are what FastAPI's path gave, status, headers and body; a bug is an
OpenAI-style 500; every other route, and another method on these paths, is FastAPI's."""

import asyncio
import re

import httpx
import pytest
from fastapi import FastAPI

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.http_app import build_app
from services.gateway.router_client import LocalRouterClient
from tests.helpers.scripted_worker import ScriptedWorker, scripted_router

KEY = {"authorization": "Bearer k1"}
CASES = [  # (path, headers, body as bytes or JSON)
    ("/v1/completions", KEY, {"model": "m", "prompt": [5, 1], "max_tokens": 6}),
    ("/v1/completions", KEY, {"model": "m", "prompt": [5, 1], "max_tokens": 6, "stream": True, "stop": ["q"]}),
    ("/v1/chat/completions", KEY, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
    ("/v1/chat/completions", KEY, {"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True}),
    ("/v1/completions", {}, {"model": "m", "prompt": "hi"}),  # 401: no key
    ("/v1/completions", {"authorization": "Bearer nope"}, {"model": "m", "prompt": "hi"}),  # 401
    ("/v1/completions", KEY, b"{not json"),  # 400
    ("/v1/completions", {**KEY, "content-type": "text/plain"}, b"prompt=hi"),  # 415
    ("/v1/completions", KEY, {"model": "other", "prompt": "hi"}),  # 404: unknown model
    ("/v1/completions", KEY, {"model": "m", "prompt": "hi", "max_tokens": "many"}),  # 422
    ("/v1/completions", KEY, {"model": "m", "prompt": "hi", "suffix": "x"}),  # 400: unsupported
    ("/v1/completions", KEY, {"model": "m", "prompt": "x" * 3000}),  # 413: over the body limit
    ("/v1/chat/completions", KEY, {"model": "m", "messages": []}),  # 400
    ("/v1/completions", KEY, {"model": "m", "prompt": [1] * 5000}),  # 413: over the context
]


async def _app():
    router = await scripted_router(ScriptedWorker())
    config = GatewayConfig("m", 4096, api_keys=("k1",), max_request_bytes=2048)
    return build_app(GatewayCore(config, load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(router)))


async def _answers(app, cases) -> list[tuple]:
    out = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for path, headers, body in cases:
            data = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post(path, headers={"content-type": "application/json", **headers}, **data)
            out.append((r.status_code, r.headers.get("content-type"), r.headers.get("retry-after"), _stable(r.content)))
    return out


def _stable(content: bytes) -> bytes:
    """Ids and times vary per request: out of the comparison."""
    return re.sub(rb'"(id|created)": ?("[^"]*"|\d+)', rb'"\1": x', content)


def test_the_direct_routes_answer_as_fastapi_did_without_entering_it(monkeypatch):
    entered: list[str] = []
    real = FastAPI.__call__

    async def counting(self, scope, receive, send):
        if scope["type"] == "http":
            entered.append(f"{scope['method']} {scope['path']}")
        await real(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counting)

    async def run():
        app = await _app()
        direct = await _answers(app, CASES)
        assert entered == []  # every POST above took the direct route
        app.direct.clear()  # the same app through FastAPI's layers
        through_fastapi = await _answers(app, CASES)
        assert len(entered) == len(CASES)
        return direct, through_fastapi

    direct, through_fastapi = asyncio.run(asyncio.wait_for(run(), 60))
    assert [a[0] for a in direct] == [200, 200, 200, 200, 401, 401, 400, 415, 404, 422, 400, 413, 400, 413]
    assert direct == through_fastapi


def test_another_method_and_other_routes_are_fastapi_s(monkeypatch):
    async def run():
        app = await _app()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            wrong = await client.get("/v1/completions", headers=KEY)
            models = await client.get("/v1/models", headers=KEY)
            missing = await client.post("/v1/completion", headers=KEY, json={})
        return wrong, models, missing

    wrong, models, missing = asyncio.run(asyncio.wait_for(run(), 30))
    assert wrong.status_code == 405 and "POST" in wrong.json()["error"]["message"]
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
    assert missing.status_code == 404 and missing.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bug_behind_a_direct_route_is_an_openai_style_500(monkeypatch, path):
    async def run():
        app = await _app()
        core = app.state.core
        monkeypatch.setattr(core, "prepare", lambda *a, **k: 1 / 0)
        body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, headers=KEY, json=body)

    r = asyncio.run(asyncio.wait_for(run(), 30))
    assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]


def test_a_refusal_with_retry_after_keeps_its_header(monkeypatch):
    from services.common.errors import ErrorCode, ServiceError

    def full(*args, **kwargs):
        raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "no room now", retry_after_s=1.5)

    async def run():
        app = await _app()
        monkeypatch.setattr(app.state.core, "admit", full)
        cases = [(path, KEY, body) for path, _, body in CASES[:4]]
        direct = await _answers(app, cases)
        app.direct.clear()
        return direct, await _answers(app, cases)

    direct, through_fastapi = asyncio.run(asyncio.wait_for(run(), 30))
    assert {(a[0], a[2]) for a in direct} == {(429, "2")} and direct == through_fastapi
