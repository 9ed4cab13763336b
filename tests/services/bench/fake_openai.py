"""A small OpenAI-compatible streaming server on 127.0.0.1 for the bench tests: fixed token timing,
and failures on demand (HTTP 500 after the first N requests, 404 for other model names)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class Behaviour:
    first_token_s: float = 0.02
    token_gap_s: float = 0.005
    fail_after: int | None = None
    """Requests after this many answer HTTP 500."""
    send_usage: bool = True
    linger_after_done_s: float = 0.0
    """How long the body stays open after [DONE] (a server that ends its streams late)."""


def _chunk(kind: str, text: str) -> str:
    choice = {"index": 0, "delta": {"content": text}} if kind == "chat" else {"index": 0, "text": text}
    return f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"


def build_app(behaviour: Behaviour, client_ports: set[int]) -> FastAPI:
    app = FastAPI()
    seen = {"requests": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def generate(request: Request, kind: str):
        body = await request.json()
        seen["requests"] += 1
        client_ports.add(request.client.port)
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": f"the model {body.get('model')!r} does not exist"}}, 404)
        if behaviour.fail_after is not None and seen["requests"] > behaviour.fail_after:
            return JSONResponse({"error": {"message": "engine crashed"}}, 500)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16

        async def events():
            await asyncio.sleep(behaviour.first_token_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(behaviour.token_gap_s)
                yield _chunk(kind, f" t{i}")
            if behaviour.send_usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            await asyncio.sleep(behaviour.linger_after_done_s)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    return app


class FakeServer:
    """Serves in a background thread; `url` is http://127.0.0.1:PORT."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.client_ports: set[int] = set()
        """The client port of every generation request: one per connection the clients opened."""
        config = uvicorn.Config(
            build_app(behaviour or Behaviour(), self.client_ports), log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            threading.Event().wait(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
