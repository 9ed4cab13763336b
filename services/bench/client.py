"""Sending one streamed request and timing its tokens as they arrive."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from services.bench.payload import error_message, parse_event
from services.bench.records import RequestRecord


async def send(http: httpx.AsyncClient, url: str, kind: str, body: dict[str, Any], prompt_len: int) -> RequestRecord:
    """POST `body` to `url`, read the SSE stream to its end; never raises on a failed request."""
    record = RequestRecord(prompt_len=prompt_len)
    record.start = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
            else:
                await _read_stream(response, kind, record)
    except httpx.TimeoutException as e:
        record.error = f"timed out ({type(e).__name__}) after {time.perf_counter() - record.start:.1f} s"
    except httpx.ConnectError as e:
        record.error = f"cannot connect to the server: {e or 'connection refused'}"
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e or 'connection failed'}"
    record.end = time.perf_counter()
    record.success = not record.error
    return record


async def _read_stream(response: httpx.Response, kind: str, record: RequestRecord) -> None:
    last = record.start
    events = 0
    parts: list[str] = []
    lines = response.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments (": keep-alive"), `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            await _finish_body(lines)
            break
        chunk = parse_event(kind, data)
        if chunk.error:
            record.error = chunk.error
            return
        if chunk.usage:
            record.prompt_len = chunk.usage.get("prompt_tokens") or record.prompt_len
            record.output_tokens = chunk.usage.get("completion_tokens") or 0
        if chunk.text is None:
            continue
        now = time.perf_counter()
        if events == 0:
            record.ttft = now - record.start
        else:
            record.itl.append(now - last)
        last = now
        events += 1
        parts.append(chunk.text)
    record.generated_text = "".join(parts)
    if events == 0:
        record.error = "the stream ended without a generated token"
    elif record.output_tokens == 0:
        record.output_tokens = events  # no usage in the stream: one token per event


_BODY_END_WAIT_S = 1.0


async def _finish_body(lines) -> None:
    """Read the rest of the body after [DONE] (the chunked terminator follows it at once), so the
    connection goes back to the pool: a response closed mid-body closes its connection, and every
    request would then open a new one and count its connect in TTFT. A server that keeps the body
    open past [DONE] is left after a second, and one that drops the connection there (no terminator)
    is no failure: the response was whole at [DONE]."""

    async def drain() -> None:
        async for _ in lines:
            pass

    try:
        await asyncio.wait_for(drain(), _BODY_END_WAIT_S)
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass
