"""A request inbox and its sink (the fast lane's entry, `services/router/inbox.py`): the sink is
offered a delta only while the request's reader is parked on an empty inbox, so it can never
overtake a delta that waits in the queue or is on its way up; a declined delta is queued and read
as before; a sink that fails ends that request with INTERNAL, not the subscription's reader."""

import asyncio

import pytest

from deepinfer_proto import common_pb2
from services.common.errors import ErrorCode, ServiceError
from services.router.inbox import RequestInbox


def _msg(i: int, finish: str = "") -> common_pb2.SampleDelta:
    return common_pb2.SampleDelta(token_offset=i, token_ids=[i], text_offset=i, text="x", finish_reason=finish)


class _Sink:
    def __init__(self, answer=True):
        self.answer = answer
        self.offered: list[int] = []

    def __call__(self, msg) -> bool:
        self.offered.append(msg.token_offset)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def _reader(inbox: RequestInbox, got: list) -> None:
    async for d in inbox.deltas():
        got.append((d.token_offset, d.token_ids))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_the_sink_takes_deltas_only_while_the_reader_is_parked_on_an_empty_inbox():
    async def run():
        inbox, sink, got = RequestInbox(None), _Sink(), []
        inbox.sink = sink
        inbox.put(_msg(0))  # no reader parked yet: queued
        reader = asyncio.ensure_future(_reader(inbox, got))
        await asyncio.sleep(0)  # the reader takes 0 and parks
        inbox.put(_msg(1))  # parked: the sink's
        inbox.put(_msg(2))
        sink.answer = False
        inbox.put(_msg(3))  # declined: queued, the reader woken
        sink.answer = True
        inbox.put(_msg(4))  # the reader is woken but has not run: queued behind 3, never the sink's
        await asyncio.sleep(0)
        inbox.put(_msg(5, finish="length"))  # the reader parked again
        sink.answer = False
        await asyncio.sleep(0)
        inbox.put(_msg(6, finish="length"))
        await reader
        return sink.offered, got, inbox.sink

    offered, got, sink_after = _run(run())
    assert offered == [1, 2, 3, 5, 6]
    assert got == [(0, [0]), (3, [3, 4]), (6, [6])]  # 3 and 4 merged: the reader fell behind
    assert sink_after is None  # the reader's end lets go of it


def test_a_sink_that_fails_ends_its_request_with_internal():
    async def run():
        inbox, got = RequestInbox(None), []
        inbox.sink = _Sink(RuntimeError("boom"))
        reader = asyncio.ensure_future(_reader(inbox, got))
        await asyncio.sleep(0)
        inbox.put(_msg(0))  # raises inside the sink: the caller (the subscription's reader) goes on
        inbox.put(_msg(1))
        with pytest.raises(ServiceError) as e:
            await reader
        return e.value, got

    error, got = _run(run())
    assert error.code is ErrorCode.INTERNAL and "boom" in error.message
    assert got == [(1, [1])]  # the next delta was queued (the sink is gone), then the failure


class _FailingLane:
    """A lane whose replay of what its native half took fails (a bug)."""

    def __init__(self):
        self.settles = 0

    def settle(self):
        self.settles += 1
        raise RuntimeError("replay failed")

    def arm(self, inbox):
        pass


def test_a_lane_whose_replay_fails_ends_that_request_with_internal_and_the_reader_goes_on():
    async def run():
        inbox, got = RequestInbox(None), []
        inbox.sink, inbox.lane = _Sink(), _FailingLane()
        lane = inbox.lane
        reader = asyncio.ensure_future(_reader(inbox, got))
        await asyncio.sleep(0)
        inbox.put(_msg(0))  # the replay before it fails: the request ends, put returns
        with pytest.raises(ServiceError) as e:
            await reader
        return e.value, lane.settles, inbox.lane, got

    error, settles, lane, got = _run(run())
    assert error.code == ErrorCode.INTERNAL and "replay failed" in error.message
    assert settles == 1 and lane is None and got == []
