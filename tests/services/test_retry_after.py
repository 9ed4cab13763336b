"""A request refused before its first byte says when to come back, on every door: a streamed HTTP
request is a 503/429 with `Retry-After` (not a 200 stream whose only event is the error), a gRPC
call's UNAVAILABLE / RESOURCE_EXHAUSTED carries `retry-after` trailing metadata, and the router's
refusal keeps its wait across the router's own gRPC hop. Real HTTP and gRPC servers on 127.0.0.1,
the real router (over gRPC) with a scripted worker whose pool is emptied and refilled."""

import time

import grpc
import httpx
import pytest

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import PUSHBACK_KEY, RETRY_AFTER_KEY
from services.common.workers import POOL_COLOCATED
from services.gateway.core import GatewayConfig
from services.router.config import RouterConfig
from tests.helpers.front import ServedFront
from tests.helpers.scripted_worker import ScriptedWorker

RETRY_S = 3


@pytest.fixture(scope="module")
def served():
    router = RouterConfig(pools=(POOL_COLOCATED,), admission_timeout_s=0.3, retry_after_s=RETRY_S)
    served = ServedFront(GatewayConfig("m", 512), ScriptedWorker(), router_config=router, router_over_grpc=True)
    yield served
    served.stop()


@pytest.fixture()
def empty_pool(served):
    worker = served.worker
    assert served.call(served.router.registry.remove("scripted"))
    yield
    served.call(served.router.registry.add(worker.info(), worker))


def _stream(served, body: dict) -> tuple[int, dict, bytes]:
    with httpx.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        return r.status_code, dict(r.headers), r.read()


def test_a_stream_refused_before_its_first_byte_is_a_503_with_retry_after(served, empty_pool):
    status, headers, body = _stream(served, {"prompt": "hello", "max_tokens": 4})
    assert status == 503, body
    assert headers["retry-after"] == str(RETRY_S) and headers["content-type"].startswith("application/json")
    assert "no colocated worker is available" in httpx.Response(503, content=body).json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
    })  # fmt: skip
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_S), r.text
    assert served.core.active == 0  # its place was given back


def test_grpc_unavailable_carries_retry_after_trailing_metadata(served, empty_pool):
    with grpc.insecure_channel(served.grpc_address) as channel:
        request = gateway_pb2.GenerateRequest(text="hello", params=common_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as e:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    trailing = dict(e.value.trailing_metadata())
    assert trailing[RETRY_AFTER_KEY] == str(RETRY_S) and trailing[PUSHBACK_KEY] == str(RETRY_S * 1000)


def test_a_stream_that_starts_is_still_an_event_stream_to_its_end(served):
    status, headers, body = _stream(served, {"prompt": "hello", "max_tokens": 4})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2 and '"error"' not in body.decode()
    deadline = time.monotonic() + 10  # the stream gives its place back once its response is over
    while served.core.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.core.active == 0
