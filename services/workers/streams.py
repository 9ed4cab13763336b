"""Where a streaming worker's (CE, NORMAL) output goes: each request's deltas, made once per
engine turn, into the outbox of whoever reads them.

An outbox is either a subscriber's (a router's `Subscribe` call: every request it reserved or
submitted, one batch per turn) or a single request's own (`Stream` / `Generate`). A request is
opened when it is admitted, before anyone reads it: a CE's first output (the hand-off) may come
before the reader does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Optional

from deepinfer_core.outputs import RequestOutput
from services.common.deltas import OutputDiffer, SampleDelta
from services.common.errors import ErrorCode, ServiceError


class Outbox:
    """Deltas waiting for one reader, as (request id, delta) pairs in the order they were made."""

    __slots__ = ("owner", "items", "requests", "closed", "_waiter")

    def __init__(self, owner: str):
        self.owner = owner
        """The subscriber id, or the request id of a request's own stream."""
        self.items: list[tuple[str, SampleDelta]] = []
        self.requests: set[str] = set()
        """Its unfinished requests: the ones to abort when the reader goes away."""
        self.closed = False
        self._waiter: Optional[asyncio.Future] = None

    def put(self, request_id: str, delta: SampleDelta) -> None:
        self.items.append((request_id, delta))
        self._wake()

    def close(self) -> None:
        """No more items: the reader ends once it has taken what is here."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def batches(self, idle_s: Optional[float] = None) -> AsyncIterator[list[tuple[str, SampleDelta]]]:
        """Everything put since the last batch: one engine turn's deltas, or several turns' when
        the reader fell behind. Ends after `close`. `idle_s`: after that long with nothing to
        send, an empty batch (traffic that keeps an idle connection alive)."""
        loop = asyncio.get_running_loop()
        while True:
            if self.items:
                items, self.items = self.items, []
                yield items
            elif self.closed:
                return
            else:
                self._waiter = loop.create_future()
                timer = loop.call_later(idle_s, self._wake) if idle_s else None
                await self._waiter
                self._waiter = None
                if timer is not None:
                    timer.cancel()
                    if not self.items and not self.closed:
                        yield []


@dataclass(slots=True)
class _Request:
    outbox: Outbox
    differ: Optional[OutputDiffer]
    """None until the first output: a CE's hand-off, whose token the client already has."""


class OutputStreams:
    def __init__(self, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        """Tokens a request's delta waits for (its first token and its end go at once): more than 1
        sends fewer, larger deltas, which saves every hop's per-message cost at the price of
        latency between them (vLLM's and SGLang's `--stream-interval`)."""
        self._requests: dict[str, _Request] = {}
        self._own: dict[str, Outbox] = {}
        """Requests read through their own stream, until that stream ends (a request may finish
        before its reader comes)."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._own

    def __len__(self) -> int:
        return len(self._requests.keys() | self._own.keys())

    def open(self, request_id: str, outbox: Optional[Outbox] = None, after_handoff: bool = False) -> None:
        """Track a request. `outbox`: its subscriber's; None gives it one of its own, read with
        `deltas`. `after_handoff`: the first output is a CE's hand-off, whose first token the
        client already has; the deltas start after it."""
        if outbox is None:
            outbox = self._own[request_id] = Outbox(request_id)
        outbox.requests.add(request_id)
        self._requests[request_id] = _Request(outbox, None if after_handoff else OutputDiffer())

    def push(self, outputs: list[RequestOutput]) -> None:
        """One engine turn's outputs: each changed request's delta goes to its outbox."""
        requests = self._requests
        interval = self.stream_interval
        for out in outputs:
            request = requests.get(out.request_id)
            if request is None:
                continue
            sample = out.outputs[0]
            differ = request.differ
            if differ is None:  # the hand-off: only its end, if the first token ended the request
                differ = request.differ = OutputDiffer.after(sample)
            elif interval > 1 and differ.num_tokens and not out.finished:
                if len(sample.token_ids) - differ.num_tokens < interval:
                    continue  # fewer than `interval` tokens since the last delta (the first went at once)
            delta = differ.diff(sample, out.num_cached_tokens)
            if delta is not None:
                request.outbox.put(out.request_id, delta)
            if out.finished:
                del requests[out.request_id]
                request.outbox.requests.discard(out.request_id)

    def close(self, request_id: str) -> bool:
        """The request was aborted: its reader sees finish_reason 'abort'. False when unknown."""
        request = self._requests.pop(request_id, None)
        # an own outbox goes too: a reader already on it keeps reading it; an aborted request gets
        # no new reader (left here, one aborted before its stream was read would stay for good)
        own = self._own.pop(request_id, None)
        if request is None:  # finished, its reader not done yet: nothing to add
            return own is not None
        request.outbox.requests.discard(request_id)
        differ = request.differ or OutputDiffer()
        abort = SampleDelta(token_offset=differ.num_tokens, text_offset=len(differ.text), finish_reason="abort")
        request.outbox.put(request_id, abort)
        return True

    def num_subscribed(self) -> int:
        """Unfinished requests whose deltas go to a subscriber."""
        return len(self._requests) - sum(1 for rid in self._own if rid in self._requests)

    async def deltas(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """A request's own stream: its deltas until it finishes. Raises NOT_FOUND for a request
        not opened with an outbox of its own."""
        outbox = self._own.get(request_id)
        if outbox is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no request {request_id!r} on this worker")
        try:
            async for items in outbox.batches():
                for _, delta in items:
                    yield delta
                    if delta.finished:
                        return
        finally:
            if self._own.get(request_id) is outbox:
                del self._own[request_id]
