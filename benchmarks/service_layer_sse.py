"""A lean HTTP/1.1 client for the gateway's OpenAI API: one keep-alive connection, requests one
after another, streamed answers read as SSE events off the chunked body.

Written on asyncio streams rather than httpx: a client process must read thousands of events a
second on a machine it shares with the head, and a general client spends several times the CPU
per event. It speaks only what uvicorn answers: a status line, headers, then either a
Content-Length body or a chunked one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Optional
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


class HttpConnection:
    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None

    async def _ensure_open(self) -> None:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
        """Send a POST; returns the status and the (lower-cased) headers of the answer."""
        await self._ensure_open()
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        self._writer.write(head.encode() + data)
        status_line = await self._reader.readline()
        if not status_line:
            raise HttpError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await self._reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body(self, headers: dict[str, str]) -> bytes:
        """The whole body of an answer whose headers were read."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            async for chunk in self.chunks():
                parts.append(chunk)
            return b"".join(parts)
        return await self._reader.readexactly(int(headers.get("content-length", "0")))

    async def chunks(self):
        """The chunks of a chunked body, until its last."""
        reader = self._reader
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readline()  # the blank line after the last chunk (no trailers)
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed request: the answer's JSON. Raises HttpError for a status other than 200."""
        status, headers = await self.post(path, body)
        data = await self.body(headers)
        if headers.get("connection", "").lower() == "close":
            self.close()
        if status != 200:
            raise HttpError(f"HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    async def stream_events(self, path: str, body: dict[str, Any], on_event: Callable[[dict], None]) -> None:
        """A streamed request: `on_event(obj)` for each SSE `data:` object, until `[DONE]`."""
        status, headers = await self.post(path, body)
        if status != 200:
            data = await self.body(headers)
            raise HttpError(f"HTTP {status}: {data[:300]!r}")
        pending = b""
        async for chunk in self.chunks():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload != b"[DONE]":
                    on_event(json.loads(payload))
