"""The fast lane with a real engine (the embedded model on CPU, greedy) behind the worker server:
a stop string that cuts the text mid-stream ends the stream exactly as without the lane, and a
request whose subscription ends mid-stream migrates and goes on, over HTTP, with the undisturbed
run's text (the lane was carrying it before the break and carries it after)."""

import asyncio
import json
import time

import pytest

from services.common.fast_lane import COUNTS
from services.gateway import http_app
from services.metrics import definitions as m
from services.workers.spec import EngineSettings
from tests.helpers.lane_front import LaneHead, post, read_response, sse_events

ARGS = EngineSettings(device="cpu", num_gpu_blocks=96, max_model_len=128, block_size=8)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def head():
    served = LaneHead(engine_args=ARGS, model_len=128)
    yield served
    served.stop()


def _body(**fields) -> dict:
    return {"model": "m", "prompt": PROMPT, "stream": True, "temperature": 0, "ignore_eos": True, **fields}


def _objs(chunks: list[bytes]) -> list[dict]:
    return [json.loads(e[len(b"data: ") : -2]) for e in sse_events(chunks)[:-1]]


def _text(objs: list[dict]) -> str:
    return "".join(o["choices"][0]["text"] for o in objs)


def _complete(head, **fields) -> list[dict]:
    sock = post(head.port, "/v1/completions", _body(**fields))
    try:
        return _objs(read_response(sock)[1])
    finally:
        sock.close()


def _end_subscriptions(head) -> int:
    """End the worker's delta subscriptions (as a worker whose stream breaks): how many there were."""

    async def end() -> int:
        outboxes = list(head.worker.core.subscribers.values())
        for outbox in outboxes:
            head.worker.core.close_subscription(outbox)
        return len(outboxes)

    return asyncio.run_coroutine_threadsafe(end(), head.worker.loop).result(10)


def test_a_stop_string_cut_mid_stream_ends_it_as_without_the_lane(head, monkeypatch):
    whole = _text(_complete(head, max_tokens=40))
    start = next(i for i in range(len(whole) // 2, len(whole) - 2) if whole[i : i + 2].strip())
    stop = whole[start : start + 2]
    cut = whole[: whole.index(stop)]
    taken = COUNTS.taken
    got = _complete(head, max_tokens=40, stop=[stop])
    assert COUNTS.taken > taken, "the lane never engaged"
    monkeypatch.setattr(http_app.SseLane, "for_request", classmethod(lambda cls, prompts, params: None))
    want = _complete(head, max_tokens=40, stop=[stop])
    for objs in (got, want):
        assert _text(objs) == cut
        assert objs[-1]["choices"][0]["finish_reason"] == "stop" and objs[-1]["choices"][0]["stop_reason"] == stop


def test_a_request_whose_subscription_ends_mid_stream_migrates_with_the_undisturbed_text(head):
    undisturbed = _text(_complete(head, max_tokens=60))
    before = m.MIGRATIONS.labels("unavailable")._value.get()
    sock = post(head.port, "/v1/completions", _body(max_tokens=60))
    try:
        received = b""
        while received.count(b"data: ") < 12:  # well into the lane's part of the stream
            received += sock.recv(1 << 16)
        taken = COUNTS.taken

        assert _end_subscriptions(head) == 1
        sock.settimeout(60)
        while not received.endswith(b"0\r\n\r\n"):
            data = sock.recv(1 << 16)
            assert data
            received += data
    finally:
        sock.close()
    events = [e for e in received.split(b"\r\n") if e.startswith(b"data: ")]
    objs = _objs(events)
    assert _text(objs) == undisturbed and objs[-1]["choices"][0]["finish_reason"] == "length"
    assert m.MIGRATIONS.labels("unavailable")._value.get() == before + 1
    assert COUNTS.taken > taken, "the lane carries the migrated stream too"


def test_leaving_mid_stream_frees_the_kv_blocks_the_router_and_the_admission_slot(head):
    sock = post(head.port, "/v1/completions", _body(max_tokens=100))
    taken = COUNTS.taken
    received = b""
    while received.count(b"data: ") < 12:
        received += sock.recv(1 << 16)
    assert COUNTS.taken > taken and b'"finish_reason": "length"' not in received  # left before the end
    sock.close()
    deadline = time.monotonic() + 30
    idle = {"router_inflight": 0, "router_tokens": 0, "inboxes": 0, "admitted": 0}
    while True:
        load = head.worker.core.stats()
        if head.idle() == idle and load.requests == 0 and load.free_blocks == load.num_blocks:
            break
        assert time.monotonic() < deadline, (head.idle(), load)
        time.sleep(0.05)


def test_a_grpc_stream_whose_subscription_ends_mid_stream_migrates_with_the_undisturbed_output(head):
    """The same over `deepinfer.v1.Gateway/Generate`: the gRPC lane's messages before and after the
    migration splice into the undisturbed run's tokens and text at the offsets they carry."""
    import grpc

    from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc

    def request(rid: str) -> gateway_pb2.GenerateRequest:
        params = common_pb2.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        r = gateway_pb2.GenerateRequest(request_id=rid, params=params)
        r.token_ids.ids.extend(PROMPT)
        return r

    def spliced(messages) -> tuple[list[int], str]:
        tokens, text = [], ""
        for msg in messages:
            d = msg.delta
            assert d.token_offset == len(tokens) and d.text_offset <= len(text)  # no gap, no overlap
            tokens[d.token_offset :] = d.token_ids
            text = text[: d.text_offset] + d.text
        return tokens, text

    with grpc.insecure_channel(f"127.0.0.1:{head.front.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        undisturbed = list(stub.Generate(request("whole"), timeout=60))
        before = m.MIGRATIONS.labels("unavailable")._value.get()
        stream = stub.Generate(request("moved"), timeout=60)
        got = [next(stream) for _ in range(12)]  # well into the lane's part of the stream
        taken = COUNTS.taken

        assert _end_subscriptions(head) == 1
        got += list(stream)
    assert spliced(got[:-1]) == spliced(undisturbed[:-1]) and len(spliced(got[:-1])[0]) == 60
    assert got[-2].delta.finish_reason == "length" and got[-1].usage.completion_tokens == 60
    assert m.MIGRATIONS.labels("unavailable")._value.get() == before + 1
    assert COUNTS.taken > taken, "the lane carries the migrated stream too"
