"""The stand-ins `gateway_path.py` drives the head's token path with: a worker client whose streams
are fed once per engine turn, and a socket transport that only counts what uvicorn writes.

`TurnSource` plays a decode worker as the router sees it once the worker -> router hop carries
one message per engine turn: each turn puts the next delta of every open stream into that
stream's `RequestInbox` (the router's own, as its subscription reader does, fast lane included),
then yields the loop once, so every consumer runs before the next turn. A reader that finds
several deltas queued takes them as one (`deltas.merge`), as the router's inbox does.
A stream carries token j = (first prompt id + j) % 256 with the text " w<id>", and ends with
finish_reason 'length' at its max_tokens.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from deepinfer_proto import common_pb2
from services.common.deltas import SampleDelta, TokenLogprob
from services.common.messages import fill_delta
from services.common.workers import POOL_COLOCATED, WorkerInfo, WorkerLoad
from services.router.inbox import RequestInbox

VOCAB = 256
WORDS = tuple(f" w{i}" for i in range(VOCAB))


class _Stream:
    def __init__(self, first_id: int, max_tokens: int, top_logprobs: Optional[int]):
        self.inbox = RequestInbox(None)
        self.first_id = first_id
        self.max_tokens = max_tokens
        self.top = top_logprobs
        self.sent_tokens = 0
        self.sent_chars = 0

    def next_delta(self) -> common_pb2.SampleDelta:
        """The next delta, as the worker's subscription carries it."""
        msg = common_pb2.SampleDelta()
        fill_delta(msg, self._next())
        return msg

    def _next(self) -> SampleDelta:
        token = (self.first_id + self.sent_tokens) % VOCAB
        text = WORDS[token]
        last = self.sent_tokens + 1 == self.max_tokens
        logprobs = None
        if self.top is not None:
            top = {(token + k) % VOCAB: -0.25 * (k + 1) for k in range(max(1, self.top))}
            logprobs = [TokenLogprob(token, top[token], top)]
        delta = SampleDelta(
            token_offset=self.sent_tokens,
            token_ids=[token],
            text_offset=self.sent_chars,
            text=text,
            logprobs=logprobs,
            finish_reason="length" if last else None,
        )
        self.sent_tokens += 1
        self.sent_chars += len(text)
        return delta


class TurnSource:
    """A colocated worker's client (`WorkerClient.generate`) with every stream fed by one turn loop."""

    def __init__(self, tokens_per_turn: int = 1):
        self.tokens_per_turn = tokens_per_turn
        """Deltas each open stream gets per turn: more than one models a head that fell behind."""
        self.streams: dict[str, _Stream] = {}
        self.finished = 0

    def info(self) -> WorkerInfo:
        big = 1 << 30
        return WorkerInfo(
            "turns", POOL_COLOCATED, 0, "local", max_model_len=1 << 16, block_size=16, num_blocks=big, max_num_seqs=big
        )

    def generate(self, request_id, prompt, params, timeout, images=(), resumed_tokens=0):
        stream = _Stream(prompt[0], params.max_tokens, params.logprobs)
        self.streams[request_id] = stream
        return self._read(request_id, stream)

    def inbox(self, request_id: str) -> Optional[RequestInbox]:
        """As `GrpcWorkerClient.inbox`: where a request's fast lane attaches."""
        stream = self.streams.get(request_id)
        return stream.inbox if stream is not None else None

    async def _read(self, request_id: str, stream: _Stream):
        try:
            async for delta in stream.inbox.deltas():
                yield delta
        finally:
            self.streams.pop(request_id, None)

    async def run(self, expected_streams: int) -> None:
        """Turns until `expected_streams` streams have ended."""
        while self.finished < expected_streams:
            for stream in list(self.streams.values()):
                for _ in range(self.tokens_per_turn):
                    if stream.sent_tokens < stream.max_tokens:
                        stream.inbox.put(stream.next_delta())
                        self.finished += stream.sent_tokens == stream.max_tokens
            await asyncio.sleep(0)

    async def abort(self, request_id, prefill) -> bool:
        return self.streams.pop(request_id, None) is not None

    async def stats(self, timeout) -> WorkerLoad:
        return WorkerLoad(worker_id="turns")

    async def close(self) -> None:
        pass


class CountingTransport(asyncio.Transport):
    """What uvicorn's protocol writes to, counted and (for one connection) kept."""

    def __init__(self, port: int, keep: bool):
        super().__init__()
        self.port = port
        self.written = 0
        self.writes = 0
        self.kept: Optional[list[bytes]] = [] if keep else None
        self.closing = False

    def write(self, data) -> None:
        self.written += len(data)
        self.writes += 1
        if self.kept is not None:
            self.kept.append(bytes(data))

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", self.port)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def http_request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class FakeGrpcContext:
    """What `GatewayService.Generate` asks of a grpc.aio servicer context."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")
