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


def test_a_stream_interval_sends_the_first_token_at_once_then_every_n_tokens_and_the_end():
    tokens, text = [11, 12, 13, 14, 15, 16, 17, 18], "abcdefgh"

    async def run(interval: int, finish_at: int):
        streams, sub = OutputStreams(stream_interval=interval), Outbox("router-a/5")
        streams.open("r", sub)
        streams.open("ce", sub, after_handoff=True)
        for n in range(1, finish_at + 1):
            finish = "length" if n == finish_at else None
            streams.push([_out("r", tokens[:n], text[:n], finish), _out("ce", tokens[:n], text[:n], finish)])
        before_abort = await _next_batch(sub)
        streams.open("cut", sub)
        for n in range(1, 4):  # an abort says where the client's stream stopped: what was sent
            streams.push([_out("cut", tokens[:n], text[:n])])
        streams.close("cut")
        return before_abort, await _next_batch(sub)

    got, cut = asyncio.run(run(3, 8))
    by_request = {rid: [(d.token_offset, d.token_ids, d.text, d.finish_reason) for r, d in got if r == rid]
                  for rid in ("r", "ce")}  # fmt: skip
    assert by_request["r"] == [
        (0, [11], "a", None),  # the first token at once
        (1, [12, 13, 14], "bcd", None),
        (4, [15, 16, 17], "efg", None),
        (7, [18], "h", "length"),  # the end at once
    ]
    assert by_request["ce"] == [
        (1, [12, 13, 14], "bcd", None),
        (4, [15, 16, 17], "efg", None),
        (7, [18], "h", "length"),
    ]
    assert [(d.token_offset, d.token_ids, d.finish_reason) for _, d in cut] == [(0, [11], None), (1, [], "abort")]
    one, _ = asyncio.run(run(1, 3))
    assert [len(d.token_ids) for r, d in one if r == "r"] == [1, 1, 1]
    try:
        OutputStreams(stream_interval=0)
    except ValueError as e:
        assert "stream_interval must be >= 1" in str(e)
    else:
        raise AssertionError("stream_interval=0 was taken")
