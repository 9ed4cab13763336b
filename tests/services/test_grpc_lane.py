"""The fast lane of the gRPC front door (`services/gateway/grpc_lane.py`) through a real head: a
worker server over gRPC read through the router's delta subscription, the router and gateway in one
process, `deepinfer.v1.Gateway/Generate` over gRPC on 127.0.0.1.

The tests run on the gateway's own HTTP/2 server (`services/common/h2_grpc`, where the lane hands
each message to its call), with the lane's compiled half (`services/native`, where it is built)
taking the ordinary deltas and with the Python lane alone (the fallback where it is not built); and
on `grpc.aio` (`--grpc-server grpcio`, where the lane's messages wait in an outbox for the handler).

What a client receives with the lane is what it receives without it, message for message and byte
for byte (text, token ids, chat, stop strings cut mid-stream, n > 1 and logprobs, which keep the
chain); the lane does engage; a client that does not read makes it step aside and loses or
reorders nothing; a client that cancels mid-stream frees the worker's request, the router's hold
and the admission slot."""

import time

import grpc
import pytest

from benchmarks.token_source import WORDS, expected_tokens
from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.fast_lane import COUNTS
from services.gateway import grpc_lane, grpc_service
from tests.helpers.lane_front import WAIT_S, concurrently, taken_by, token_source_head

STEP_S = 0.02
"""Slow enough that the head sends every step's message before the next: one token a message in
every run, so the runs compare message for message."""


@pytest.fixture(scope="module", params=["native-h2", "python-h2", "native-grpcio"])
def head(request):
    kind, server = request.param.split("-")
    with token_source_head(kind, STEP_S, server) as served:
        served.channel = grpc.insecure_channel(f"127.0.0.1:{served.front.grpc_port}")
        served.stub = gateway_pb2_grpc.GatewayStub(served.channel)
        yield served
        served.channel.close()


def _request(case: dict) -> gateway_pb2.GenerateRequest:
    case = dict(case)
    prompt = case.pop("prompt")
    request = gateway_pb2.GenerateRequest(request_id=case.pop("request_id"), params=common_pb2.SamplingParams(**case))
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list):
        request.token_ids.ids.extend(prompt)
    else:
        request.chat.messages.add(role="user", content=prompt["chat"])
    return request


def _stream(head, case: dict) -> list[bytes]:
    return [m.SerializeToString() for m in head.stub.Generate(_request(case), timeout=WAIT_S)]


def _concurrently(head, cases: list[dict]) -> list[list[bytes]]:
    return concurrently(lambda case: _stream(head, case), cases)


CASES = [
    dict(request_id="a", prompt=[5, 1, 2], max_tokens=24),
    dict(request_id="b", prompt="hello there", max_tokens=24),
    dict(request_id="c", prompt={"chat": "hi 0"}, max_tokens=20),
    dict(request_id="d", prompt=[9, 1, 2], max_tokens=20, stop=["zz", "w1 w"]),  # held back while a stop could form
    dict(request_id="e", prompt=[3, 1, 2], max_tokens=12, n=2, seed=1),  # n > 1: the chain
    dict(request_id="f", prompt=[7, 1, 2], max_tokens=12, logprobs=2),  # logprobs: the chain
]


def _by_choice(messages: list[bytes]) -> dict:
    """Each choice's messages in order (n > 1 interleaves its choices as timing decides); the usage under None."""
    out: dict = {}
    for raw in messages:
        msg = gateway_pb2.GenerateResponse.FromString(raw)
        out.setdefault(msg.delta.index if msg.HasField("delta") else None, []).append(raw)
    return out


def _content(messages: list[bytes]) -> tuple:
    """What a choice's messages carried, whatever their cut (a reader that fell behind merges)."""
    tokens, text = [], ""
    finish = None
    for raw in messages:
        d = gateway_pb2.GenerateResponse.FromString(raw).delta
        tokens[d.token_offset :] = d.token_ids
        text = text[: d.text_offset] + d.text
        finish = d.finish_reason or finish
    return tokens, text, finish


def test_concurrent_streams_are_byte_identical_with_and_without_the_lane(head, monkeypatch):
    taken = COUNTS.taken
    with_lane = _concurrently(head, CASES)
    assert COUNTS.taken - taken > 40, "the lane never engaged"
    with monkeypatch.context() as m:
        m.setattr(grpc_service.GrpcLane, "for_request", classmethod(lambda cls, *_: None))
        taken = COUNTS.taken
        reference = _concurrently(head, CASES)
        assert COUNTS.taken == taken
    for case, got, want in zip(CASES, with_lane, reference):
        mine, theirs = _by_choice(got), _by_choice(want)
        assert mine.keys() == theirs.keys() and mine[None] == theirs[None], case  # the usage: exact
        for index in mine:
            assert _content(mine[index]) == _content(theirs[index]), case
            if len(mine[index]) == len(theirs[index]):
                assert mine[index] == theirs[index], case  # one token a message in both: byte for byte


def test_messages_that_wait_together_go_as_one():
    """A handler that fell behind sends what waited in the outbox as one message: the first's
    offsets, every token and all the text in order, the sample's cached count."""
    from collections import deque

    from services.common.deltas import SampleDelta
    from services.common.messages import fill_delta

    def message(delta: SampleDelta) -> bytes:
        msg = gateway_pb2.GenerateResponse(request_id="r")
        fill_delta(msg.delta, delta)
        return msg.SerializeToString()

    outbox = deque(
        [
            message(SampleDelta(0, 7, [11], 20, "ab", num_cached_tokens=4)),
            message(SampleDelta(0, 8, [12, 13], 22, "é")),
            message(SampleDelta(0, 10, [14], 23, "", num_cached_tokens=4)),
        ]
    )
    merged = gateway_pb2.GenerateResponse.FromString(grpc_lane._merged(outbox, "r"))
    assert not outbox and merged.request_id == "r"
    d = merged.delta
    assert (d.token_offset, list(d.token_ids), d.text_offset, d.text) == (7, [11, 12, 13, 14], 20, "abé")
    assert d.num_cached_tokens == 4 and not d.finish_reason


def test_the_lane_carries_the_ordinary_stream_in_order(head):
    tokens = 60
    taken = taken_by(head)
    cases = [dict(request_id=f"o{p}", prompt=[p, 1, 2], max_tokens=tokens) for p in range(8)]
    streams = _concurrently(head, cases)
    assert taken_by(head) - taken >= 8 * (tokens // 2), "most tokens should take the lane"
    for p, messages in enumerate(streams):
        want = expected_tokens([p], tokens)
        ids, text, finish = _content(messages[:-1])
        assert ids == want and text == "".join(WORDS[t] for t in want) and finish == "length"
        usage = gateway_pb2.GenerateResponse.FromString(messages[-1]).usage
        assert usage.completion_tokens == tokens and usage.prompt_tokens == 3


def test_a_client_that_does_not_read_gets_every_message_in_order(head):
    """The client does not read while the stream outgrows HTTP/2's flow-control window: the server
    holds the handler, the lane steps aside (on `grpc.aio` once its outbox fills; on the gateway's
    own server once a message waits for the window), the deltas after wait in the inbox, merged;
    every token arrives, in order."""
    tokens, paused = 3000, COUNTS.paused
    head.engine.step_period_s = 0.002
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    channel = grpc.insecure_channel(f"127.0.0.1:{head.front.grpc_port}", options=options)
    try:
        stream = gateway_pb2_grpc.GatewayStub(channel).Generate(
            _request(dict(request_id="slow", prompt=[11, 1, 2], max_tokens=tokens, stop=["zz"])), timeout=WAIT_S
        )
        first = next(stream)
        deadline = time.monotonic() + WAIT_S
        while COUNTS.paused == paused:  # not reading until the lane had to step aside
            assert time.monotonic() < deadline, "the lane never stepped aside"
            time.sleep(0.05)
        messages = [first.SerializeToString()] + [m.SerializeToString() for m in stream]
    finally:
        head.engine.step_period_s = STEP_S
        channel.close()
    want = expected_tokens([11], tokens)
    ids, text, _ = _content(messages[:-1])
    assert ids == want and text == "".join(WORDS[t] for t in want)
    assert len(messages) < tokens, "what waited in the inbox came merged"


def test_cancelling_mid_stream_frees_everything(head):
    taken = COUNTS.taken
    stream = head.stub.Generate(_request(dict(request_id="gone", prompt=[4, 1, 2], max_tokens=4000)), timeout=WAIT_S)
    for i, _ in enumerate(stream):
        if i == 20:
            break
    assert COUNTS.taken > taken
    stream.cancel()
    deadline = time.monotonic() + WAIT_S
    idle = {"router_inflight": 0, "router_tokens": 0, "inboxes": 0, "admitted": 0}
    while head.idle() != idle or head.engine.requests:
        assert time.monotonic() < deadline, (head.idle(), len(head.engine.requests))
        time.sleep(0.05)
