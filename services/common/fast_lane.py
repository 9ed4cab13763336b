"""The fast lane: one streamed request's ordinary mid-stream deltas taken synchronously, in the
router's subscription reader, instead of waking the request's task.

Without it every token wakes the request's task and climbs a chain of async generators (inbox ->
worker client -> sample flow -> router -> gateway -> SSE events -> the HTTP response's pump), each
resumed once per token, to do a few lines of bookkeeping and one socket write. With it, once the
request is in its steady phase, the subscription reader hands each of its deltas to `offer`,
which does the same work in one pass: the router's part (`route`: the sample's progress and its
assembler, stop-string holdback included) and the front door's (`ready`/`deliver`: the choice, the
chunk, the write; `services/gateway/sse_lane.py` for SSE, `services/gateway/grpc_lane.py` for gRPC).

The lane only takes what the chain would pass through unchanged in shape: a delta that does not
finish its sample (a finish, an error, a broken stream go the chain's way, where migration, usage
and [DONE] are), carries no logprobs, and arrives while the request's reader is parked on an
empty inbox (`RequestInbox.put` checks that), so nothing older of that request is still on its
way and token order holds. When it declines (`False`), the delta is queued and the chain handles
it exactly as it would have without a lane. `offer` decides before it changes anything: a delta
is either wholly the lane's or wholly the chain's.

A lane may also have a `native` half (`services/native/delta_lane.c`): armed by the inbox when the
request's reader parks (`arm`), it takes the same deltas in compiled code straight from the
subscription's bytes, and keeps what it took (token ids, text, times) without touching the
request's Python objects. Before anything else looks at them, that is before the inbox queues a
delta, fails, or lets its reader go, `settle` disarms it and replays what it took through the same
steps, as one merged delta (`absorb`): the router's progress and assembler, the gateway's choice and
clock end exactly as if the Python lane had taken each delta. It is armed only where that replay is
exact: the sample's progress, its assembler and the client at one edge, no stop-string holdback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from services.common.deltas import SampleDelta
from services.common.messages import delta_from_proto
from services.native import lanes_taken


class LaneCounts:
    """This process's totals (tests and benchmarks read them: did the lane engage, did it step aside)."""

    __slots__ = ("python_taken", "declined", "paused")

    def __init__(self):
        self.python_taken = 0
        """Deltas the Python lane took."""
        self.declined = 0
        """Deltas offered that went to the queue instead."""
        self.paused = 0
        """Of those, declined because the connection's writes were paused (a client not reading)."""

    @property
    def taken(self) -> int:
        """Deltas the lanes took, Python's and the native ones."""
        return self.python_taken + lanes_taken()


COUNTS = LaneCounts()


class FastLane:
    """A request's lane; the front door's subclass says when it can take a delta and delivers it."""

    __slots__ = ("route", "progress", "assembler", "native")

    def __init__(self):
        self.route: Optional[Callable[[SampleDelta], Optional[SampleDelta]]] = None
        """The router's steps for one delta of the request's one sample (what the client may see of
        it, None: nothing yet); set by the router when the request has one sample, with the two
        objects they change (`SampleProgress`, `SampleAssembler`)."""
        self.progress = None
        self.assembler = None
        self.native = None
        """The compiled half (`services.native.NativeLane`), where the front door made one."""

    def attach(self, client, request_id: str):
        """The inbox of `request_id` (the router's current attempt at the request's one sample) on a
        worker's `client`, now feeding this lane; None when that client has none (an in-process
        worker's: the lane never engages)."""
        find = getattr(client, "inbox", None)
        inbox = find(request_id) if find is not None else None
        if inbox is not None:
            inbox.sink = self.offer
            inbox.lane = self
        return inbox

    def detach(self, inbox) -> None:
        if inbox.lane is self:
            self.settle()
            inbox.sink = inbox.lane = inbox.native = None

    def arm(self, inbox) -> None:
        """The request's reader parks on `inbox`, empty: the native half may take its next deltas,
        if the front door can write now and the sample is at one edge everywhere."""
        native = self.native
        if native is None or self.route is None or not self.ready():
            return
        tokens, chars, base_tokens, base_chars = self.progress.edge()
        if self.assembler.edge() != (tokens, chars):
            return
        inbox.native = native
        native.arm(tokens, chars, base_tokens, base_chars, self.assembler.num_cached_tokens)

    def settle(self) -> None:
        """Disarm the native half and replay what it took into the request's objects."""
        native = self.native
        if native is None:
            return
        native.disarm()
        taken = native.take_pending()
        if taken is None:
            return
        token_offset, token_ids, text_offset, text, cached, first_at, last_at, clean = taken
        delta = SampleDelta(0, token_offset, token_ids, text_offset, text, None, None, None, None, cached)
        out = self.route(delta)
        if clean is not None:
            self.progress.mark_clean(*clean)
        self.absorb(out, first_at, last_at)

    def offer(self, msg) -> bool:
        """Take `msg` (a `common_pb2.SampleDelta`) now, or decline it (False: it is queued). The
        caller has checked that the request's reader is parked on its empty inbox."""
        if msg.finish_reason or msg.logprobs or self.route is None or not self.ready():
            COUNTS.declined += 1
            return False
        delta = self.route(delta_from_proto(msg))
        if delta is not None:
            self.deliver(delta)
        COUNTS.python_taken += 1
        return True

    def ready(self) -> bool:
        """Whether the front door can deliver a delta now, without waiting."""
        return False

    def deliver(self, delta: SampleDelta) -> None:
        """What the chain above the router does with a mid-stream delta; never waits, never fails."""
        raise NotImplementedError

    def absorb(self, delta: Optional[SampleDelta], first_at: float, last_at: float) -> None:
        """`deliver` without the write: the native half sent its events already (`first_at`,
        `last_at`: when it took the first and the last of them, `time.monotonic`)."""
        raise NotImplementedError
