"""The fast lane's front-door half for a streamed `deepinfer.v1.Gateway/Generate` (`services/common/fast_lane.py`).

Without it, each token of a gRPC stream climbs the whole chain of async generators (inbox -> worker
client -> sample flow -> router -> `GatewayCore.generate` -> the handler), and the handler builds a
`GenerateResponse` for it. `grpc.aio` sends only from the handler's own task, so no lane can write to
the connection the way the SSE lane does. What this lane does instead is put each ordinary
mid-stream delta's `GenerateResponse`, already serialized, in the request's `outbox`, and wake the
handler: the handler's stream (`messages`) yields those bytes as they are (the method's serializer
passes bytes through: `grpc_service.py`), and only the deltas the lane does not take go the chain's way.

Messages that wait together in the outbox (the handler was still sending when they came) go as
one, merged as the inbox merges what waited for a reader.

The chain runs in a task of its own beside the outbox. Order holds: the lane takes a delta only
while the request's reader is parked on an empty inbox, and whatever the reader yields next came
after everything the lane took, which `messages` sends first.

It takes deltas once the stream's first message is out (the chain's, as without a lane), and only
while fewer than `OUTBOX_LIMIT` messages wait: a client that does not read stops the handler in
grpc's flow control, the outbox stops growing, and the deltas after wait in the inbox, merged into
one when the handler comes back (as every delta did before there was a lane).

Where `services.native` is built, its compiled half writes the same bytes for the same deltas
straight from the subscription's (`NativeLane(..., grpc=True)`), through `ready` and `write` below.

On the gateway's own HTTP/2 server (`services/common/h2_grpc`) the lane is a `DirectGrpcLane`,
without an outbox.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Optional, Union

from deepinfer_proto import gateway_pb2
from services.common.deltas import merge
from services.common.fast_lane import COUNTS
from services.common.h2_grpc.call import ServerCall
from services.common.messages import delta_from_proto, fill_delta
from services.gateway.front_lane import FrontLane
from services.native import NativeLane

OUTBOX_LIMIT = 64
"""Messages the lane lets wait for the handler before it steps aside."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _merged(outbox: deque, request_id: str) -> bytes:
    """The messages waiting in `outbox` (consecutive mid-stream deltas of one sample) as one, taken
    out: a handler that fell behind sends one message for them, merged as the inbox merges a reader's."""
    parse = gateway_pb2.GenerateResponse.FromString
    delta = delta_from_proto(parse(outbox.popleft()).delta)
    while outbox:
        delta = merge(delta, delta_from_proto(parse(outbox.popleft()).delta))
    msg = gateway_pb2.GenerateResponse(request_id=request_id)
    fill_delta(msg.delta, delta)
    return msg.SerializeToString()


class GrpcLane(FrontLane):
    __slots__ = ("request_id", "outbox", "open", "_waiter")

    def __init__(self, request_id: str):
        super().__init__()
        self.request_id = request_id
        self.outbox: deque[bytes] = deque()
        """Serialized `GenerateResponse`s the lane took, in order, until the handler sends them."""
        self.open = False
        """True while `messages` runs, from its first message on."""
        self._waiter: Optional[asyncio.Future] = None
        if NativeLane is not None:
            rid = request_id.encode()
            head = b"\x0a" + _varint(len(rid)) + rid  # GenerateResponse.request_id (field 1)
            self.native = NativeLane(self, None, None, head, b"", grpc=True)

    @classmethod
    def for_request(cls, request_id: str, params, context) -> Optional[GrpcLane]:
        """A lane for a request of one sample without logprobs (the bulk of streams); None otherwise.
        `context`: the handler's (a call of the gateway's own server takes messages directly)."""
        if params.n != 1 or params.logprobs is not None:
            return None
        if isinstance(context, ServerCall):
            return DirectGrpcLane(request_id, context)
        return cls(request_id)

    # ---- what the lanes call ------------------------------------------------------------------
    def ready(self) -> bool:
        if len(self.outbox) >= OUTBOX_LIMIT:
            COUNTS.paused += 1  # the handler is held (a client that does not read)
            return False
        return self.open

    def write(self, message: bytes) -> None:
        """One serialized `GenerateResponse` for the handler (the native half calls this too)."""
        self.outbox.append(message)
        self._wake()

    def deliver(self, delta) -> None:
        self.note(delta)
        msg = gateway_pb2.GenerateResponse(request_id=self.request_id)
        fill_delta(msg.delta, delta)
        self.write(msg.SerializeToString())

    # ---- the handler's side ---------------------------------------------------------------------
    def _wake(self, _=None) -> None:
        """Resume the handler if it waits: a message is in the outbox, or the chain has its next."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def messages(self, deltas: AsyncIterator) -> AsyncIterator[Union[bytes, tuple]]:
        """`deltas` (the request's `GatewayCore.generate`, given this lane) with what the lane took
        in between, in order: bytes (a `GenerateResponse` to send as it is) or the chain's
        (choice, delta). Closing it closes `deltas` (which aborts the request upstream)."""
        loop = asyncio.get_running_loop()
        outbox = self.outbox
        pending = None
        try:
            while True:
                if outbox:
                    yield outbox.popleft() if len(outbox) == 1 else _merged(outbox, self.request_id)
                    continue
                if pending is None:
                    pending = loop.create_task(deltas.__anext__())
                    pending.add_done_callback(self._wake)
                if pending.done():
                    try:
                        item = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                    yield item
                    self.open = True  # the stream's first message is out
                    continue
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            self.open = False
            self._waiter = None
            if pending is not None:
                if not pending.done():
                    pending.cancel()
                    await asyncio.wait((pending,))
                if not pending.cancelled():
                    pending.exception()  # the stream is over: what it raised goes no further (nor to the log)
            await deltas.aclose()


class DirectGrpcLane(GrpcLane):
    """The lane on the gateway's own HTTP/2 server: any task may send on a call, so the lane hands
    each message to it (`ServerCall.send_now`), which frames it on the connection at once, while
    nothing waits before it on that stream (`can_send_now`: the client's windows and the socket have
    room). The handler only relays the chain's items; the order holds as for the SSE lane: the
    chain's reader parks on the empty inbox only once its previous item is sent."""

    __slots__ = ("_call",)

    def __init__(self, request_id: str, call: ServerCall):
        super().__init__(request_id)
        self._call = call

    def ready(self) -> bool:
        if not self.open:
            return False
        if self._call.can_send_now():
            return True
        COUNTS.paused += 1  # the client's windows or the socket hold the stream back
        return False

    def write(self, message: bytes) -> None:
        self._call.send_now(message)

    async def messages(self, deltas: AsyncIterator) -> AsyncIterator[tuple]:
        """`deltas` as they come: the lane sends what it takes itself."""
        try:
            async for item in deltas:
                yield item
                self.open = True  # the stream's first message is out
        finally:
            self.open = False
            await deltas.aclose()
