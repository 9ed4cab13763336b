"""One request's deltas on the router, between its worker's subscription and the request's reader.

The subscription's reader puts each delta in (`put`, one append); the request's reader takes
them out (`deltas`). A reader that fell behind takes everything queued as one merged delta, so
a slow consumer costs one message downstream, not one per token. Cheaper than an
`asyncio.Queue`: a deque and one waiter, no locks, no per-item futures.

A `sink` (the request's fast lane, `services/common/fast_lane.py`) is offered a delta instead of
the queue while the reader is parked on an empty inbox: taken there, it wakes no task at all. The
lane's compiled half (`native`), armed while the reader is parked, takes deltas before they reach
`put`; whatever this inbox does next in Python starts by settling it (`FastLane.settle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Optional

from deepinfer_proto import common_pb2
from services.common.deltas import SampleDelta, merge
from services.common.errors import ErrorCode, ServiceError
from services.common.messages import delta_from_proto

logger = logging.getLogger(__name__)


class RequestInbox:
    __slots__ = ("subscription", "sink", "lane", "native", "_queue", "_waiter", "_error", "_timer")

    def __init__(self, subscription: object):
        self.subscription = subscription
        """The subscription that feeds it: when that breaks, so does the inbox."""
        self._queue: deque[common_pb2.SampleDelta] = deque()
        self._waiter: Optional[asyncio.Future] = None
        self._error: Optional[ServiceError] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self.sink: Optional[Callable[[common_pb2.SampleDelta], bool]] = None
        """Offered each delta while the reader waits on an empty inbox; True: taken (not queued)."""
        self.lane = None
        """The fast lane `sink` belongs to (`FastLane`): armed and settled from here."""
        self.native = None
        """Its compiled half, read by the subscription's native dispatch (set by `FastLane.arm`)."""

    def put(self, msg: common_pb2.SampleDelta) -> None:
        if not self._settle():  # what the lane's native half took goes into the request's objects first
            return
        lane = self.lane
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # the reader is parked: nothing of this request is queued or on its way up, so a sink
            # that takes the delta now keeps the request's order
            sink = self.sink
            if sink is not None and self._error is None:
                try:
                    if sink(msg):
                        if lane is not None:
                            lane.arm(self)  # still parked
                        return
                except Exception as e:  # a bug: end this request, never the subscription's reader
                    self.sink_failed(e)
                    return
            self._queue.append(msg)
            waiter.set_result(None)
        else:
            self._queue.append(msg)

    def sink_failed(self, e: BaseException) -> None:
        """The lane failed on a delta (a bug): this request ends, the subscription goes on."""
        logger.error("the fast lane failed", exc_info=e)
        if self.native is not None:
            self.native.disarm()
        self.sink = self.lane = self.native = None
        self.fail(ServiceError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"))

    def _settle(self) -> bool:
        """Replay what the lane's native half took (`FastLane.settle`); False: that failed (a bug),
        and the request with it."""
        lane = self.lane
        if lane is None:
            return True
        try:
            lane.settle()
        except Exception as e:
            self.sink_failed(e)
            return False
        return True

    def fail(self, error: ServiceError) -> None:
        """End the stream with `error` once what is queued has been taken (the first error wins)."""
        self._settle()
        if self._error is None:
            self._error = error
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def expire_at(self, loop: asyncio.AbstractEventLoop, when: float, what: str) -> None:
        """Fail with DEADLINE_EXCEEDED at loop time `when` (one timer per request, not a wait per delta)."""
        self._timer = loop.call_at(when, self._expire, what)

    def _expire(self, what: str) -> None:
        self.fail(ServiceError(ErrorCode.DEADLINE_EXCEEDED, f"{what}: the request ran past its deadline"))

    async def deltas(self) -> AsyncIterator[SampleDelta]:
        """The request's deltas until one finishes it; raises the error it failed with."""
        loop = asyncio.get_running_loop()
        queue = self._queue
        try:
            while True:
                if queue:
                    delta = delta_from_proto(queue.popleft())
                    while queue and not delta.finished:  # fell behind: one delta for all of it
                        delta = merge(delta, delta_from_proto(queue.popleft()))
                    yield delta
                    if delta.finished:
                        return
                elif self._error is not None:  # a fresh exception: one error may end many inboxes
                    raise ServiceError(self._error.code, self._error.message)
                else:
                    self._waiter = loop.create_future()
                    if self.lane is not None and self.sink is not None:
                        self.lane.arm(self)
                    await self._waiter
                    self._waiter = None
        finally:
            self._settle()
            self.sink = None
            if self._timer is not None:
                self._timer.cancel()
