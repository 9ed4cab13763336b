"""The streamed SSE bytes are exactly what the chunk dicts + `json.dumps` gave, and a streamed
answer carries what the non-streamed one does: completions and chat, logprobs, n > 1, several
prompts, stop strings, include_usage and characters that JSON or SSE framing could get wrong.

The reference below is the per-token formatting the gateway had before it serialized chunks from
per-request templates; it is kept here, and only here, as the definition of the bytes."""

import asyncio
import json

import httpx
import pytest

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from services.gateway.core import GatewayConfig, GatewayCore, usage
from services.gateway.event_streams import chat_events, completion_events
from services.gateway.http_app import build_app
from services.gateway.responses import Formatter
from services.gateway.router_client import LocalRouterClient
from tests.helpers.scripted_worker import ScriptedWorker, scripted_router

_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _old_sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n".encode()


def _old_head(fmt: Formatter, obj: str) -> dict:
    return {"id": fmt.id, "object": obj, "created": fmt.created, "model": fmt.model}


def _old_completion_chunk(fmt: Formatter, index: int, text_len: int, delta) -> dict:
    logprobs = fmt.completion_logprobs(delta.logprobs or [], text_len - len(delta.text))
    choice = {"index": index, "text": delta.text, "logprobs": logprobs}
    choice |= {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
    return {**_old_head(fmt, "text_completion"), "choices": [choice], "usage": None}


def _old_chat_chunk(fmt: Formatter, index: int, content: dict, finish, lps=None, stop=None) -> dict:
    choice = {"index": index, "delta": content, "logprobs": fmt.chat_logprobs(lps) if lps else None}
    choice |= {"finish_reason": finish, "stop_reason": stop}
    return {**_old_head(fmt, "chat.completion.chunk"), "choices": [choice], "usage": None}


def _old_events(fmt: Formatter, recorded: list, chat: bool, include_usage: bool) -> bytes:
    """The old event stream over what the gateway core yielded: (choice, its text length then, delta)."""
    out, seen = [], {}
    for choice, text_len, delta in recorded:
        if not chat:
            seen[choice.index] = choice
            out.append(_old_sse(_old_completion_chunk(fmt, choice.index, text_len, delta)))
            continue
        if choice.index not in seen:
            seen[choice.index] = choice
            out.append(_old_sse(_old_chat_chunk(fmt, choice.index, {"role": "assistant", "content": ""}, None)))
        content = {"content": delta.text} if delta.text else {}
        if content or delta.logprobs or delta.finished:
            chunk = _old_chat_chunk(fmt, choice.index, content, delta.finish_reason, delta.logprobs, delta.stop_reason)
            out.append(_old_sse(chunk))
    if include_usage:
        obj = "chat.completion.chunk" if chat else "text_completion"
        out.append(_old_sse(fmt.usage_chunk(obj, usage(list(seen.values())))))
    return b"".join(out) + b"data: [DONE]\n\n"


class _Recording:
    """The gateway core, with what its `generate` yields written down."""

    def __init__(self, core: GatewayCore):
        self.core = core
        self.recorded: list = []

    async def generate(self, prompts, params, request_id, images=()):
        async for choice, delta in self.core.generate(prompts, params, request_id, images):
            self.recorded.append((choice, choice.text_len, delta))
            yield choice, delta


async def _gateway(burst: int = 1) -> GatewayCore:
    router = await scripted_router(ScriptedWorker(burst))
    return GatewayCore(GatewayConfig("m", 4096), load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(router))


CASES = [
    dict(prompts=[[5, 1]], fields=dict(max_tokens=12)),
    dict(prompts=[[9, 1]], fields=dict(max_tokens=20, stop=["hello", "q\\"]), top=3),
    dict(prompts=[[3, 2]], fields=dict(max_tokens=9, n=3, seed=4), top=0),
    dict(prompts=[[1, 2], [7, 7, 7]], fields=dict(max_tokens=15, n=2, seed=1, stop=["c"]), usage=True),
    dict(prompts=[[2, 3], [4]], fields=dict(max_tokens=30, stop=["\u2029"]), top=2, usage=True, burst=3),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_streamed_events_are_the_old_bytes(case, chat):
    async def run():
        core = await _gateway(case.get("burst", 1))
        top = case.get("top")
        params = core.prepare(case["prompts"], {**case["fields"], "logprobs": top})
        fmt = Formatter(core.tokenizer, "cmpl-x\u2028", "m\x85", top)  # volatile fields made awkward
        recording = _Recording(core)
        events = (chat_events if chat else completion_events)(
            recording, case["prompts"], params, fmt, case.get("usage", False)
        )
        got = b"".join([e async for e in events])
        return got, _old_events(fmt, recording.recorded, chat, case.get("usage", False)), recording.recorded

    got, want, recorded = asyncio.run(asyncio.wait_for(run(), 30))
    assert recorded and got == want


def _request(chat: bool, stream: bool, case: dict) -> dict:
    fields = {**case["fields"], "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    top = case.get("top")
    if chat:
        assert len(case["prompts"]) == 1
        messages = [{"role": "user", "content": f"hi {case['prompts'][0][0]}"}]
        return {**fields, "messages": messages, "logprobs": top is not None, "top_logprobs": top}
    return {**fields, "prompt": case["prompts"], "logprobs": top}


def _events(body: bytes) -> list[dict]:
    """The events of an SSE body; each must be one `data:` line that is its own json.dumps."""
    assert body.endswith(b"data: [DONE]\n\n")
    events = []
    for block in body.decode().split("\n\n")[:-2]:
        assert block.startswith("data: ") and "\n" not in block
        obj = json.loads(block[6:])
        assert block[6:] == json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)
        events.append(obj)
    return events


def _joined(events: list[dict], chat: bool) -> dict[int, dict]:
    """Per choice index: the text, finish and logprobs the events carry, put together."""
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            got = out.setdefault(c["index"], {"text": "", "finish_reason": None, "lp": []})
            got["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
            if c["logprobs"]:
                got["lp"] += _listed(c["logprobs"], chat)
    return out


def _listed(logprobs: dict, chat: bool) -> list:
    """One entry per token. A completion chunk's `text_offset` counts from the text sent before it,
    which a held-back stop string leaves behind the tokens: it is not compared."""
    if chat:
        return logprobs["content"]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]))


def _whole(body: dict, chat: bool) -> dict[int, dict]:
    out = {}
    for c in body["choices"]:
        lp = _listed(c["logprobs"], chat) if c["logprobs"] else []
        text = c["message"]["content"] if chat else c["text"]
        out[c["index"]] = {"text": text, "finish_reason": c["finish_reason"], "lp": lp}
    return out


@pytest.mark.parametrize(
    "case, chat", [(c, chat) for c in CASES for chat in (False, True) if not chat or len(c["prompts"]) == 1]
)
def test_a_streamed_answer_carries_what_the_whole_answer_does(case, chat):
    async def run():
        app = build_app(await _gateway(case.get("burst", 1)))
        url = "/v1/chat/completions" if chat else "/v1/completions"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            whole = await client.post(url, json=_request(chat, False, case))
            streamed = await client.post(url, json=_request(chat, True, case))
        return whole, streamed

    whole, streamed = asyncio.run(asyncio.wait_for(run(), 30))
    assert whole.status_code == streamed.status_code == 200, whole.text
    events = _events(streamed.content)
    assert _joined(events[:-1], chat) == _whole(whole.json(), chat)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole.json()["usage"]
