"""`merge` of two consecutive deltas, and the router's request inbox that uses it: a reader
that fell behind gets one delta equal to everything it missed, applied one by one."""

import asyncio
import random

import pytest

from deepinfer_core.outputs import CompletionOutput
from services.common.deltas import OutputDiffer, SampleAssembler, SampleDelta, TokenLogprob, merge
from services.common.errors import ErrorCode, ServiceError
from services.common.messages import delta_to_proto
from services.router.inbox import RequestInbox


def _state(deltas: list[SampleDelta]) -> tuple:
    """What a receiver holds after applying `deltas` in order (and what it may hand out)."""
    asm = SampleAssembler(0)
    for d in deltas:
        asm.apply(d)
    return asm.tokens, asm.logprobs, asm.text, asm.finish_reason, asm.stop_reason, asm.error, asm.num_cached_tokens


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5 - token / 100, {token: -0.5 - token / 100, 999: -3.0})


def test_tokens_text_and_logprobs_are_spliced_in_order():
    a = SampleDelta(token_offset=3, token_ids=[7, 8], text_offset=10, text="ab", logprobs=[_lp(7), _lp(8)])
    b = SampleDelta(token_offset=5, token_ids=[9], text_offset=12, text="c", logprobs=[_lp(9)], num_cached_tokens=4)
    m = merge(a, b)
    assert (m.token_offset, m.token_ids, m.text_offset, m.text) == (3, [7, 8, 9], 10, "abc")
    assert m.logprobs == [_lp(7), _lp(8), _lp(9)] and m.num_cached_tokens == 4 and m.finish_reason is None


def test_a_stop_string_that_cuts_the_text_back():
    # "Hello wor" went out; the next step finds the stop string "wor" and cuts it off
    a = SampleDelta(token_offset=0, token_ids=[1, 2, 3], text_offset=0, text="Hello wor")
    b = SampleDelta(token_offset=3, token_ids=[4], text_offset=6, text="", finish_reason="stop", stop_reason="wor")
    m = merge(a, b)
    assert (m.token_ids, m.text_offset, m.text) == ([1, 2, 3, 4], 0, "Hello ")
    assert (m.finish_reason, m.stop_reason) == ("stop", "wor")
    # the cut may reach behind everything the first delta brought
    c = SampleDelta(token_offset=4, token_ids=[], text_offset=2, text="", finish_reason="stop", stop_reason="llo")
    base = SampleDelta(token_offset=0, token_ids=[1, 2], text_offset=0, text="Hel")
    assert _state([base, merge(a, c)]) == _state([base, a, c])
    assert merge(SampleDelta(text_offset=5, text="xy"), c).text_offset == 2


def test_an_abort_after_tokens_with_logprobs_keeps_them():
    a = SampleDelta(token_offset=1, token_ids=[5], text_offset=1, text="z", logprobs=[_lp(5)])
    abort = SampleDelta(token_offset=2, text_offset=2, finish_reason="abort")
    m = merge(a, abort)
    assert m.logprobs == [_lp(5)] and m.finish_reason == "abort" and m.token_ids == [5]
    assert merge(SampleDelta(token_ids=[1]), SampleDelta(token_offset=1, token_ids=[2])).logprobs is None


def _differ_stream(rng: random.Random) -> list[SampleDelta]:
    """Deltas of a random sample whose text grows and sometimes moves back, as a worker makes them."""
    differ, tokens, text, deltas = OutputDiffer(), [], "", []
    for step in range(rng.randint(1, 12)):
        tokens.append(rng.randint(0, 50))
        text += rng.choice(["a", "bc", "", " d", "\ufffd"])
        if text and rng.random() < 0.2:
            text = text[: rng.randint(0, len(text))]  # a stop string or a fixed-up byte cut it back
        last = step == 11 or rng.random() < 0.1
        lps = [{t: -1.0 - t / 10} for t in tokens]
        out = CompletionOutput(0, text, list(tokens), logprobs=lps, finish_reason="stop" if last else None)
        delta = differ.diff(out, num_cached_tokens=step)
        if delta is not None:
            deltas.append(delta)
        if last:
            break
    return deltas


def test_merging_any_run_of_a_stream_equals_applying_it_delta_by_delta():
    rng = random.Random(7)
    for _ in range(300):
        deltas = _differ_stream(rng)
        i = rng.randint(0, len(deltas) - 1)
        j = rng.randint(i, len(deltas) - 1)
        run = deltas[i]
        for d in deltas[i + 1 : j + 1]:
            run = merge(run, d)
        assert _state(deltas[:i] + [run] + deltas[j + 1 :]) == _state(deltas)


def _inbox_with(deltas: list[SampleDelta]) -> RequestInbox:
    inbox = RequestInbox(subscription=None)
    for d in deltas:
        inbox.put(delta_to_proto(d))
    return inbox


async def _take(inbox: RequestInbox) -> list[SampleDelta]:
    return [d async for d in inbox.deltas()]


def test_an_inbox_whose_reader_fell_behind_yields_one_merged_delta():
    streams = (_differ_stream(random.Random(seed)) for seed in range(1000))
    deltas = next(s for s in streams if len(s) >= 3 and s[-1].finished)
    got = asyncio.run(asyncio.wait_for(_take(_inbox_with(deltas)), 5))
    assert len(got) == 1 and _state(got) == _state(deltas)


def test_an_inbox_hands_out_what_is_queued_before_its_error_and_expires_on_its_deadline():
    async def failed():
        inbox = _inbox_with([SampleDelta(token_ids=[1], text="a")])
        inbox.fail(ServiceError(ErrorCode.UNAVAILABLE, "worker w is unreachable"))
        got = []
        with pytest.raises(ServiceError) as e:
            async for d in inbox.deltas():
                got.append(d)
        return got, e.value

    got, error = asyncio.run(asyncio.wait_for(failed(), 5))
    assert [d.token_ids for d in got] == [[1]] and error.code is ErrorCode.UNAVAILABLE

    async def expired():
        loop = asyncio.get_running_loop()
        inbox = RequestInbox(subscription=None)
        inbox.expire_at(loop, loop.time() + 0.05, "worker w")
        with pytest.raises(ServiceError) as e:
            await _take(inbox)
        return e.value

    error = asyncio.run(asyncio.wait_for(expired(), 5))
    assert error.code is ErrorCode.DEADLINE_EXCEEDED and "worker w" in error.message


@pytest.mark.parametrize("seed", range(20))
def test_the_assembler_s_text_grows_in_place_and_is_handed_out_as_a_plain_string_s_slices(seed):
    """The assembler appends a delta's text at the end in place (no copy of all the text before it)
    and cuts it back when a delta moves the text back; what it holds and what `take` and `push`
    hand out equal a plain string's slices, stop-string holdback included."""
    rng = random.Random(seed)
    holdback = rng.choice([0, 0, 2, 5])
    asm, text, sent, client, cut_sent_text = SampleAssembler(0, holdback), "", 0, "", False
    for _ in range(60):
        offset = len(text) if rng.random() < 0.8 else rng.randrange(len(text) + 1)  # mostly at the end
        piece = "".join(rng.choice("ab\u00e9\u4e2d") for _ in range(rng.randrange(4)))
        d = SampleDelta(token_offset=len(asm.tokens), token_ids=[1], text_offset=offset, text=piece)
        text = text[:offset] + piece
        cut_sent_text |= offset < sent
        got = asm.push(d) if rng.random() < 0.5 else (asm.apply(d), asm.take())[1]
        limit = max(sent, len(text) - holdback)
        assert got.text == (text[sent:limit] if limit > sent else "") and asm.text == text
        client = client[: got.text_offset] + got.text
        sent = limit
    end = asm.push(SampleDelta(token_offset=len(asm.tokens), text_offset=len(text), finish_reason="length"))
    client = client[: end.text_offset] + end.text
    assert asm.text == text and (cut_sent_text or client == text)
