"""The fast lane (`services/common/fast_lane.py`, `services/gateway/sse_lane.py`) through a real
head: a worker server over gRPC read through the router's delta subscription, the router and
gateway in one process, uvicorn (httptools) on 127.0.0.1, raw HTTP/1.1 clients.

Every test runs twice: with the lane's compiled half (`services/native`, where it is built) taking
the ordinary deltas, and with the Python lane alone (the fallback where it is not built).

What a client receives with the lane is what it receives without it, byte for byte (event by
event, framing included), for completions and chat, several streams at once, stop-string holdback,
include_usage, n > 1 and logprobs (which keep the chain); the lane does engage for the ordinary
stream; a client that does not read makes the lane step aside and loses or reorders nothing;
leaving mid-stream frees the worker's request, the router's hold and the admission slot."""

import json
import re
import time

import httpx
import pytest

from benchmarks.token_source import WORDS, expected_tokens
from services.common.fast_lane import COUNTS
from services.gateway import http_app
from tests.helpers.lane_front import WAIT_S, concurrently, post, read_response, sse_events, taken_by, token_source_head

_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_VOLATILE = re.compile(rb'"id": "(cmpl|chatcmpl)-[0-9a-f]+", "object": "([a-z._]+)", "created": \d+')
STEP_S = 0.02
"""The token source's step: slow enough that the head serves every step's delta before the next
(one token an event either way, so the runs compare event for event)."""


@pytest.fixture(scope="module", params=["native", "python"])
def head(request):
    with token_source_head(request.param, STEP_S) as served:
        yield served


@pytest.fixture
def without_lane(monkeypatch):
    """The reference: every delta through the chain, as before the lane existed."""
    monkeypatch.setattr(http_app.SseLane, "for_request", classmethod(lambda cls, prompts, params: None))


def _events(chunks: list[bytes]) -> list[bytes]:
    """The body's events (`sse_events`), ids and times made equal."""
    return [_VOLATILE.sub(rb'"id": "\1-x", "object": "\2", "created": 0', e) for e in sse_events(chunks)]


def _check_format(event: bytes) -> dict:
    """The event is `json.dumps(obj, ensure_ascii=False)` of what it carries, on one line."""
    text = event[len(b"data: ") : -2].decode()
    if text == "[DONE]":
        return {}
    obj = json.loads(text)
    assert json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS) == text
    return obj


def _stream(head, chat: bool, prompt_id: int, tokens: int, **fields) -> list[bytes]:
    body = {"model": "m", "max_tokens": tokens, "stream": True, **fields}
    if chat:
        body["messages"] = [{"role": "user", "content": f"hi {prompt_id}"}]
    else:
        body["prompt"] = [prompt_id, 1, 2]
    sock = post(head.port, "/v1/chat/completions" if chat else "/v1/completions", body)
    try:
        head_bytes, chunks = read_response(sock)
    finally:
        sock.close()
    assert head_bytes.startswith(b"HTTP/1.1 200"), head_bytes
    return _events(chunks)


def _concurrently(head, cases: list[dict]) -> list[list[bytes]]:
    return concurrently(lambda case: _stream(head, **case), cases)


CASES = [
    dict(chat=False, prompt_id=5, tokens=24),
    dict(chat=True, prompt_id=0, tokens=24),
    dict(chat=False, prompt_id=9, tokens=20, stop=["zz", "w1 w"]),  # held back while a stop could form
    dict(chat=True, prompt_id=0, tokens=16, stream_options={"include_usage": True}),
    dict(chat=False, prompt_id=3, tokens=12, n=2, seed=1),  # n > 1: the chain
    dict(chat=False, prompt_id=7, tokens=12, logprobs=2),  # logprobs: the chain
    dict(chat=True, prompt_id=0, tokens=12, logprobs=True, top_logprobs=1),
]


def test_concurrent_streams_are_byte_identical_with_and_without_the_lane(head, monkeypatch):
    taken = COUNTS.taken
    with_lane = _concurrently(head, CASES)
    assert COUNTS.taken - taken > 40, "the lane never engaged"
    with monkeypatch.context() as m:
        m.setattr(http_app.SseLane, "for_request", classmethod(lambda cls, prompts, params: None))
        taken = COUNTS.taken
        reference = _concurrently(head, CASES)
        assert COUNTS.taken == taken
    for case, got, want in zip(CASES, with_lane, reference):
        objs = [_check_format(e) for e in got]
        assert got[-1] == b"data: [DONE]\n\n" and objs[-2 if "stream_options" not in case else -3]["choices"]
        mine, theirs = _by_choice(got), _by_choice(want)
        assert _content(mine) == _content(theirs), case
        if [len(v) for v in mine.values()] == [len(v) for v in theirs.values()]:
            assert mine == theirs, case  # one token an event in both runs: event for event, byte for byte


def _by_choice(events: list[bytes]) -> dict:
    """Each choice's events in order (n > 1 interleaves its choices as their deltas arrive, which
    timing decides); the events without a choice (usage, [DONE]) under None."""
    out: dict = {}
    for e in events:
        obj = _check_format(e)
        index = obj["choices"][0]["index"] if obj.get("choices") else None
        out.setdefault(index, []).append(e)
    return dict(sorted(out.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))


def _content(by_choice: dict) -> dict:
    """What each choice carried, whatever the events' cut: a reader that fell behind on a loaded
    machine merges the deltas waiting for it into one event (in either run)."""
    out = {}
    for index, events in by_choice.items():
        objs = [_check_format(e) for e in events]
        if index is None:
            out[index] = events  # usage and [DONE]: exact
            continue
        pieces, finish, logprobs = [], None, []
        for o in objs:
            c = o["choices"][0]
            pieces.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            finish = c.get("finish_reason") or finish
            lp = c.get("logprobs") or {}
            logprobs += lp.get("content") or list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))
        out[index] = ("".join(pieces), finish, json.dumps(logprobs, ensure_ascii=False))
    return out


def test_the_lane_carries_the_ordinary_stream_in_order(head):
    tokens = 60
    taken = taken_by(head)
    streams = _concurrently(head, [dict(chat=False, prompt_id=p, tokens=tokens) for p in range(8)])
    assert taken_by(head) - taken >= 8 * (tokens // 2), "most tokens should take the lane"
    for p, events in enumerate(streams):
        objs = [_check_format(e) for e in events[:-1]]
        text = "".join(o["choices"][0]["text"] for o in objs)
        assert text == "".join(WORDS[t] for t in expected_tokens([p], tokens))
        assert objs[-1]["choices"][0]["finish_reason"] == "length"


def test_a_client_that_does_not_read_gets_every_byte_in_order(head):
    """The client's receive buffer fills, uvicorn pauses writing: the lane steps aside (the chain
    waits for the drain, and merges what queued meanwhile); the text arrives whole and in order."""
    tokens, paused = 1500, COUNTS.paused
    head.engine.step_period_s = 0.002
    try:
        body = {"model": "m", "prompt": [11, 1, 2], "max_tokens": tokens, "stream": True, "stop": ["zz"]}
        sock = post(head.port, "/v1/completions", body, rcvbuf=2048)
        try:
            deadline = time.monotonic() + WAIT_S
            while not head.squeeze_connection(sock):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            while COUNTS.paused == paused:  # not reading until the server had to hold writes back
                assert time.monotonic() < deadline, "the server's writes never paused"
                time.sleep(0.05)
            time.sleep(0.3)
            _, chunks = read_response(sock)
        finally:
            sock.close()
    finally:
        head.engine.step_period_s = STEP_S
    objs = [_check_format(e) for e in _events(chunks)[:-1]]
    text = "".join(o["choices"][0]["text"] for o in objs)
    assert text == "".join(WORDS[t] for t in expected_tokens([11], tokens))
    assert len(objs) < tokens, "what queued behind the paused writes comes merged"


def test_leaving_mid_stream_frees_everything(head):
    taken = COUNTS.taken
    body = {"model": "m", "prompt": [4, 1, 2], "max_tokens": 4000, "stream": True}
    sock = post(head.port, "/v1/completions", body)
    deadline = time.monotonic() + WAIT_S
    received = b""
    while received.count(b"data: ") < 10:
        assert time.monotonic() < deadline
        received += sock.recv(1 << 16)
    assert COUNTS.taken > taken
    sock.close()
    idle = {"router_inflight": 0, "router_tokens": 0, "inboxes": 0, "admitted": 0}
    while head.idle() != idle or head.engine.requests:
        assert time.monotonic() < deadline, (head.idle(), len(head.engine.requests))
        time.sleep(0.05)


def test_an_asgi_test_client_gets_every_event_through_the_chain(head):
    """No uvicorn cycle behind the app (httpx's ASGI transport): the lane is offered the deltas and
    declines each one; the chain delivers them all."""

    async def via_asgi() -> bytes:
        transport = httpx.ASGITransport(app=head.front.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "m", "prompt": [6, 1, 2], "max_tokens": 20, "stream": True}
            response = await client.post("/v1/completions", json=body)
            return response.content

    taken, declined = COUNTS.taken, COUNTS.declined
    body = head.call(via_asgi())
    assert COUNTS.taken == taken and COUNTS.declined - declined >= 10
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    objs = [_check_format(e) for e in _events(events)[:-1]]
    assert "".join(o["choices"][0]["text"] for o in objs) == "".join(WORDS[t] for t in expected_tokens([6], 20))


def test_a_stream_interval_sends_fewer_larger_events_with_the_same_content(head):
    """`--stream-interval 4`: the worker sends a request's tokens four at a time (its first and its
    end at once). Each choice carries the same text, finish, logprobs and usage as one token an
    event, in about a quarter of the events, through the lane and through the chain (n > 1, logprobs)."""
    reference = _concurrently(head, CASES)
    streams = head.worker.core.streams
    streams.stream_interval = 4
    try:
        taken = COUNTS.taken
        got = _concurrently(head, CASES)
        assert COUNTS.taken > taken, "the lane never engaged"
    finally:
        streams.stream_interval = 1
    for case, mine, theirs in zip(CASES, got, reference):
        mine, theirs = _by_choice(mine), _by_choice(theirs)
        assert _content(mine) == _content(theirs), case
        for index in mine:
            if index is not None:  # the first token, then 4 a time (a stop string's holdback may add one)
                assert len(mine[index]) <= 2 + -(-(case["tokens"] - 1) // 4), (case, len(mine[index]))
