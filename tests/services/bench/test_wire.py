"""The request bodies, the reading of streamed chunks, and the arrival process."""

import asyncio

import httpx
import numpy as np
import pytest

from services.bench.arrivals import arrival_offsets
from services.bench.client import send
from services.bench.driver import Target
from services.bench.payload import CHAT, COMPLETIONS, Sampling, endpoint_kind, parse_event, request_body
from services.bench.records import BenchRequest
from tests.services.bench.fake_openai import MODEL, Behaviour, FakeServer


def test_bodies_stream_with_usage_and_carry_the_sampling_fields():
    request = BenchRequest([5, 6, 7], 3, 12)
    body = request_body(COMPLETIONS, "m", request, Sampling(temperature=0.5, ignore_eos=True, extra_body={"seed": 3}))
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "temperature": 0.5,
        "ignore_eos": True,
        "seed": 3,
    }
    chat = request_body(CHAT, "m", BenchRequest("hi", 1, 4), Sampling())
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_completion_tokens"] == 4
    with pytest.raises(ValueError, match="text prompts"):
        request_body(CHAT, "m", request, Sampling())
    assert endpoint_kind("/v1/chat/completions") == CHAT and endpoint_kind("/v1/completions/") == COMPLETIONS
    with pytest.raises(ValueError):
        endpoint_kind("/v1/embeddings")
    assert Target("http://h:1/v1", "m").url == "http://h:1/v1/completions"


def test_which_chunks_count_as_tokens():
    # completions: a chunk is a step of tokens even when its text is "" (a split UTF-8 character)
    assert parse_event(COMPLETIONS, '{"choices": [{"text": ""}], "usage": null}').text == ""
    assert parse_event(COMPLETIONS, '{"choices": [], "usage": {"completion_tokens": 3}}').text is None
    # chat: the role-only chunk and empty deltas carry no token
    assert parse_event(CHAT, '{"choices": [{"delta": {"role": "assistant", "content": ""}}]}').text is None
    assert parse_event(CHAT, '{"choices": [{"delta": {"content": "hey"}}]}').text == "hey"
    assert "boom" in parse_event(CHAT, '{"error": {"message": "boom"}}').error
    assert "not JSON" in parse_event(CHAT, "{oops").error


@pytest.mark.parametrize("send_usage", [True, False])
def test_output_tokens_come_from_usage_when_the_stream_gives_it(send_usage):
    server = FakeServer(Behaviour(first_token_s=0.05, token_gap_s=0.01, send_usage=send_usage))

    async def one():
        async with httpx.AsyncClient(timeout=10) as http:
            body = request_body(COMPLETIONS, MODEL, BenchRequest("x", 1, 6), Sampling())
            return await send(http, f"{server.url}/v1/completions", COMPLETIONS, body, prompt_len=1)

    try:
        r = asyncio.run(one())
    finally:
        server.stop()
    assert r.success and r.output_tokens == 6 and len(r.itl) == 5
    assert r.prompt_len == (7 if send_usage else 1)  # the server's count replaces the dataset's
    assert r.ttft >= 0.05 and r.latency >= 0.099  # the server waits 50 ms, then 10 ms between tokens
    assert r.generated_text == " t0 t1 t2 t3 t4 t5"


def test_requests_in_turn_reuse_one_connection_and_a_body_left_open_after_done_is_not_waited_for():
    server = FakeServer(Behaviour(first_token_s=0.01, token_gap_s=0.001))
    lingering = FakeServer(Behaviour(first_token_s=0.01, token_gap_s=0.001, linger_after_done_s=30.0))

    async def in_turn(url: str, n: int):
        async with httpx.AsyncClient(timeout=60) as http:
            body = request_body(COMPLETIONS, MODEL, BenchRequest("x", 1, 4), Sampling())
            return [await send(http, f"{url}/v1/completions", COMPLETIONS, body, prompt_len=1) for _ in range(n)]

    try:
        records = asyncio.run(in_turn(server.url, 5))
        late = asyncio.run(in_turn(lingering.url, 1))[0]
    finally:
        server.stop()
        lingering.stop()
    assert all(r.success and r.output_tokens == 4 for r in records)
    # the body is read to its end after [DONE], so the connection goes back to the pool: one connect,
    # not one per request (whose connect would be timed inside TTFT)
    assert len(server.client_ports) == 1, server.client_ports
    assert late.success and late.output_tokens == 4 and late.latency < 5.0  # left after ~1 s, not 30


def test_a_connection_dropped_right_after_done_still_counts_as_a_whole_response():
    """A server that closes the connection after `[DONE]` without the chunked terminator: the
    response was whole, so the request succeeded (httpx raises on the missing terminator)."""
    events = b"".join(
        b"%x\r\n%b\r\n" % (len(e), e)
        for e in [b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n', b"data: [DONE]\n\n"]
    )

    async def scenario():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.read(1 << 16)  # the body (small, sent at once)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(events)  # no b"0\r\n\r\n": the body never ends properly
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(timeout=10) as http:
            body = request_body(COMPLETIONS, MODEL, BenchRequest("x", 1, 1), Sampling())
            return await send(http, f"http://127.0.0.1:{port}/v1/completions", COMPLETIONS, body, prompt_len=1)

    r = asyncio.run(scenario())
    assert r.success, r.error
    assert r.generated_text == " a" and r.output_tokens == 1


def test_arrivals_poisson_gamma_constant_and_all_at_once():
    assert arrival_offsets(4, float("inf"), 1.0, seed=0) == [0.0] * 4
    poisson = np.diff(arrival_offsets(20001, 10.0, 1.0, seed=0))
    bursty = np.diff(arrival_offsets(20001, 10.0, 0.25, seed=0))
    assert poisson.mean() == pytest.approx(0.1, rel=0.03) and bursty.mean() == pytest.approx(0.1, rel=0.05)
    # coefficient of variation of gamma gaps = 1 / sqrt(shape): 1 for Poisson, 2 at burstiness 0.25
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert arrival_offsets(3, 2.0, 1.0, seed=5) == arrival_offsets(3, 2.0, 1.0, seed=5)
    assert arrival_offsets(4, 8.0, float("inf"), seed=0) == [0.0, 0.125, 0.25, 0.375]  # a constant rate
    for rate, burstiness in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, burstiness, seed=0)
