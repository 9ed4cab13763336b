"""Deltas that wait together travel as one: the merge of several streams folds each stream's
waiting deltas (never past a failure), the gateway sends one SSE event with their joined text,
and usage still counts every token. The router assembler's pass-through equals apply + take."""

import asyncio
import json
import random

import pytest

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from services.common.deltas import SampleAssembler, SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.stream_merge import merge
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.event_streams import completion_events
from services.gateway.responses import Formatter
from services.gateway.router_client import LocalRouterClient
from tests.helpers.scripted_worker import PIECES, ScriptedWorker, scripted_router, token_at
from tests.services.test_delta_merge import _differ_stream


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _queued(deltas: list[SampleDelta], error: Exception = None):
    """A stream whose deltas are all there at once (no turn of the loop between them)."""
    for d in deltas:
        yield d
    if error is not None:
        raise error


def _tokens(stream: int, count: int, finish_last: bool = True) -> list[SampleDelta]:
    return [
        SampleDelta(
            token_offset=j,
            token_ids=[stream * 100 + j],
            text_offset=j,
            text=chr(97 + j),
            finish_reason="length" if finish_last and j == count - 1 else None,
        )
        for j in range(count)
    ]


def test_the_merge_folds_each_streams_waiting_deltas_into_one():
    async def run():
        return [item async for item in merge([_queued(_tokens(0, 4)), _queued(_tokens(1, 3))])]

    got = _run(run())
    assert [(i, d.token_ids, d.text, d.finish_reason) for i, d in got] == [
        (0, [0, 1, 2, 3], "abcd", "length"),
        (1, [100, 101, 102], "abc", "length"),
    ]


def test_the_merge_folds_each_sample_apart_when_one_stream_carries_several():
    """A gateway's stream is one prompt's, with its n samples interleaved: waiting deltas are folded
    per sample, never one sample's text spliced into another's."""
    interleaved = [
        SampleDelta(index=j % 2, token_offset=j // 2, token_ids=[j], text_offset=j // 2, text="xy"[j % 2])
        for j in range(6)
    ]

    async def run():
        return [item async for item in merge([_queued(interleaved), _queued(_tokens(1, 2))])]

    got = _run(run())
    assert [(i, d.index, d.token_ids, d.text) for i, d in got] == [
        (0, 0, [0, 2, 4], "xxx"),
        (0, 1, [1, 3, 5], "yyy"),
        (1, 0, [100, 101], "ab"),
    ]


def test_a_failure_is_not_folded_and_a_stream_error_comes_after_what_came_before_it():
    failed = SampleDelta(token_offset=2, text_offset=2, finish_reason="error", error="engine died")

    async def run(streams):
        got = []
        with pytest.raises(ServiceError) as e:
            async for item in merge(streams):
                got.append(item)
        return got, e.value

    broken = ServiceError(ErrorCode.UNAVAILABLE, "worker w is unreachable")
    got, error = _run(run([_queued([*_tokens(0, 2, False), failed]), _queued(_tokens(1, 2, False), broken)]))
    assert [(i, d.text, d.finish_reason) for i, d in got] == [(0, "ab", None), (0, "", "error"), (1, "ab", None)]
    assert error is broken


def test_waiting_deltas_go_out_as_one_event_with_their_joined_text_and_exact_usage():
    burst, max_tokens, n = 4, 10, 2

    async def run():
        router = await scripted_router(ScriptedWorker(burst))
        core = GatewayCore(GatewayConfig("m", 4096), load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(router))
        params = core.prepare([[3, 1]], {"max_tokens": max_tokens, "n": n, "seed": 5})
        fmt = Formatter(core.tokenizer, "cmpl-1", "m", None)
        return [e async for e in completion_events(core, [[3, 1]], params, fmt, include_usage=True)]

    items = _run(run())
    assert items[-1].endswith(b"data: [DONE]\n\n") and all(not i.endswith(b"[DONE]\n\n") for i in items[:-1])
    events = [json.loads(e[6:]) for e in b"".join(items).split(b"\n\n")[:-2]]  # the last item: the end's events
    chunks, last = events[:-1], events[-1]
    assert len(chunks) == n * -(-max_tokens // burst)  # one event per burst and sample, not one per token
    for i in range(n):
        want = "".join(PIECES[token_at([3, 1], 5 + i, j) % len(PIECES)] for j in range(max_tokens))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) == want
    assert last["usage"]["completion_tokens"] == n * max_tokens


@pytest.mark.parametrize("holdback", [0, 2])
def test_the_assemblers_pass_through_equals_apply_then_take(holdback):
    rng = random.Random(holdback)
    for _ in range(300):
        deltas = _differ_stream(rng)
        index = rng.randint(0, 2)
        fast, slow = SampleAssembler(index, holdback), SampleAssembler(index, holdback)
        for d in deltas:
            if rng.random() < 0.3:
                d.logprobs = None
            want = (slow.apply(d), slow.take())[1]
            assert fast.push(d) == want
        assert vars(fast) == vars(slow)
