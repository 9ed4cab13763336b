"""What the front doors' fast lanes share (`sse_lane.py`, `grpc_lane.py`): the request's `Choice`
and `StreamClock`, kept exactly as `GatewayCore.generate` keeps them for the deltas it yields."""

from __future__ import annotations

from services.common.fast_lane import FastLane


class FrontLane(FastLane):
    __slots__ = ("choice", "clock")

    def __init__(self):
        super().__init__()
        self.choice = None
        """The request's `Choice`, and its `StreamClock`: set by `GatewayCore.generate`."""
        self.clock = None

    def note(self, delta) -> None:
        """A mid-stream delta the lane delivers, into the choice and the clock (it cannot fail: no finish)."""
        self.choice.add(delta)
        self.clock.tick(delta)

    def absorb(self, delta, first_at: float, last_at: float) -> None:
        clock = self.clock
        if delta is not None:
            self.choice.add(delta)
            if clock.first_at is None and delta.token_ids:
                clock.first_at = first_at
        clock.last_at = last_at
