"""A streaming worker's outboxes as plain units: one engine turn's outputs become one batch per
subscriber with one delta per changed request; a subscriber that falls behind gets the turns it
missed in one batch; a request read through its own stream still gets one delta at a time."""

import asyncio

from deepinfer_core.outputs import CompletionOutput, RequestOutput
from services.workers.streams import Outbox, OutputStreams


def _out(request_id: str, tokens: list[int], text: str, finish=None) -> RequestOutput:
    sample = CompletionOutput(0, text, tokens, finish_reason=finish)
    return RequestOutput(request_id, None, [1, 2], [sample], finished=finish is not None)


async def _next_batch(outbox: Outbox) -> list:
    batches = outbox.batches()
    try:
        return await asyncio.wait_for(anext(batches), 5)
    finally:
        await batches.aclose()


def test_one_turn_is_one_batch_holding_every_changed_request():
    async def run():
        streams, sub = OutputStreams(), Outbox("router-a/1")
        for rid in ("a", "b", "c"):
            streams.open(rid, sub)
        streams.push([_out("a", [5], "x"), _out("b", [6], "y"), _out("other", [1], "?")])
        first = await _next_batch(sub)
        streams.push([_out("a", [5, 7], "xz"), _out("c", [8], "w", finish="length")])
        streams.push([_out("a", [5, 7, 9], "xz!", finish="stop"), _out("b", [6, 1], "yq")])  # not read in between
        second = await _next_batch(sub)
        return first, second, sub.requests, len(streams)

    first, second, left, tracked = asyncio.run(run())
    assert [(rid, d.token_offset, d.token_ids, d.text) for rid, d in first] == [("a", 0, [5], "x"), ("b", 0, [6], "y")]
    assert [(rid, d.token_ids, d.finish_reason) for rid, d in second] == [
        ("a", [7], None),
        ("c", [8], "length"),
        ("a", [9], "stop"),
        ("b", [1], None),
    ]
    assert left == {"b"} and tracked == 1  # finished requests leave their outbox


def test_a_hand_off_primes_the_stream_and_an_abort_says_where_it_stopped():
    async def run():
        streams, sub = OutputStreams(), Outbox("router-a/2")
        streams.open("ce", sub, after_handoff=True)
        streams.push([_out("ce", [5], "he")])  # the hand-off: its token went out with the PE's reply
        streams.push([_out("ce", [5, 6], "hey")])
        got = await _next_batch(sub)
        found = streams.close("ce")
        abort = await _next_batch(sub)
        return got, found, abort, "ce" in streams

    got, found, abort, still = asyncio.run(run())
    assert [(d.token_offset, d.token_ids, d.text_offset, d.text) for _, d in got] == [(1, [6], 2, "y")]
    ((_, d),) = abort
    assert found and not still and (d.token_offset, d.text_offset, d.finish_reason) == (2, 3, "abort")


def test_a_request_of_its_own_is_read_delta_by_delta_even_after_it_finished():
    async def run():
        streams = OutputStreams()
        streams.open("own")
        streams.push([_out("own", [1], "a")])
        streams.push([_out("own", [1, 2], "ab", finish="length")])  # finished before its reader came
        assert "own" in streams and streams.num_subscribed() == 0
        got = [d async for d in streams.deltas("own")]
        return got, len(streams)

    got, left = asyncio.run(asyncio.wait_for(run(), 5))
    assert [(d.token_ids, d.finish_reason) for d in got] == [([1], None), ([2], "length")] and left == 0


def test_an_idle_subscription_sends_empty_batches_and_ends_when_closed():
    async def run():
        sub = Outbox("router-a/3")
        batches = sub.batches(idle_s=0.02)
        first = await asyncio.wait_for(anext(batches), 5)
        sub.close()
        rest = [b async for b in batches]
        return first, rest

    first, rest = asyncio.run(run())
    assert first == [] and rest == []
