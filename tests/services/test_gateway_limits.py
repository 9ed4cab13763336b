"""The gateway's limits through its real HTTP and gRPC servers (a scripted worker behind them):
admission counts sequences, not requests; a refusal for want of room says when to retry (HTTP
`Retry-After`, gRPC trailing metadata); huge inputs are refused at once on both doors while other
requests go on being served."""

import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import PUSHBACK_KEY, RETRY_AFTER_KEY
from services.gateway.core import GatewayConfig
from tests.helpers.front import ServedFront
from tests.helpers.scripted_worker import ScriptedWorker

SEQUENCES = 64
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def served():
    config = GatewayConfig("m", 512, max_concurrent_sequences=SEQUENCES)
    served = ServedFront(config, ScriptedWorker(token_delay_s=0.05))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.grpc_address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _completion(served, timeout_s: float = 60.0) -> int:
    body = {"prompt": "hello", "max_tokens": 2}
    return httpx.post(f"{served.url}/v1/completions", json=body, timeout=timeout_s).status_code


def test_one_request_of_64_prompts_x_8_is_refused_by_the_sequence_limit(served):
    body = {"prompt": ["hello"] * 64, "n": 8, "max_tokens": 2}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "512 sequences" in error["message"] and "at most 64" in error["message"]
    assert served.core.admission.in_flight("sequences") == 0


def _hold(served, prompts: int, n: int, release: threading.Event) -> threading.Thread:
    """A streamed request of `prompts` x `n` sequences that stays in flight until `release` is set."""

    def run():
        body = {"prompt": ["hello"] * prompts, "n": n, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_bytes():
                if release.is_set():
                    return  # closing the stream aborts the request

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_no_room_is_429_with_retry_after_and_resource_exhausted_with_retry_metadata(served, stub):
    release = threading.Event()
    holder = _hold(served, 8, 8, release)  # all 64 sequences
    try:
        assert _wait(lambda: served.core.admission.in_flight("sequences") == SEQUENCES)
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.json()["error"]["type"] == "rate_limit_error" and "sequences in flight" in r.json()["error"]["message"]
        request = gateway_pb2.GenerateRequest(text="hi", params=common_pb2.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(e.value.trailing_metadata())
        assert 1 <= int(trailing[RETRY_AFTER_KEY]) <= 60
        assert int(trailing[PUSHBACK_KEY]) == 1000 * int(trailing[RETRY_AFTER_KEY])
    finally:
        release.set()
        holder.join(30)
    assert _wait(lambda: served.core.admission.in_flight("sequences") == 0)
    assert _completion(served) == 200


def test_huge_inputs_are_refused_at_once_while_other_requests_complete(served, stub):
    outcomes: dict[str, object] = {}

    def grpc_60_mib():
        request = gateway_pb2.GenerateRequest(text="word " * (12 * MiB))
        try:
            list(stub.Generate(request, timeout=60))
        except grpc.RpcError as e:
            outcomes["grpc"] = e.code()

    def http(name: str, size: int):
        body = {"prompt": "word " * (size // 5), "max_tokens": 2}
        outcomes[name] = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).status_code

    def small_ones():
        outcomes["small"] = [_completion(served) for _ in range(10)]

    threads = [
        threading.Thread(target=grpc_60_mib),
        threading.Thread(target=http, args=("http_8_mib", 8 * MiB + 100)),
        threading.Thread(target=http, args=("http_under_the_limit", 8 * MiB - 1000)),
        threading.Thread(target=small_ones),
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.monotonic() - started
    assert outcomes["grpc"] == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the same 8 MiB as HTTP's
    assert outcomes["http_8_mib"] == 413  # over the body limit
    assert outcomes["http_under_the_limit"] == 413  # over the context length, seen from its head
    assert outcomes["small"] == [200] * 10, outcomes
    print(f"huge inputs refused and 10 small requests served in {took:.2f} s")


_HUGE_CLIENT = """
import sys, grpc, httpx
from deepinfer_proto import gateway_pb2, gateway_pb2_grpc
url, address, MiB = sys.argv[1], sys.argv[2], 1024 * 1024
stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
for _ in range(3):
    try:
        list(stub.Generate(gateway_pb2.GenerateRequest(text="word " * (12 * MiB)), timeout=60))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
    for size in (8 * MiB + 100, 8 * MiB - 1000):
        r = httpx.post(url + "/v1/completions", json={"prompt": "word " * (size // 5)}, timeout=60)
        assert r.status_code == 413, r.text
"""


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def test_refused_huge_requests_leave_no_memory_held(served):
    """The server (this process) reads no more of a huge request than its limit: nine of them
    refused (the client is another process) leave its resident memory much as it was."""
    before = _rss_mb()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", _HUGE_CLIENT, served.url, served.grpc_address]
    subprocess.run(cmd, check=True, timeout=300, env=env)
    grown = _rss_mb() - before
    print(f"resident memory grew {grown:.0f} MB")
    assert grown < 200  # reading one 8 MiB prompt whole and tokenizing it cost ~700 MB


def test_a_fault_of_the_server_is_a_500_on_a_connection_that_stays_open(served):
    """A bug (here a tokenizer that breaks) is answered 500 with an error body, and the client's
    keep-alive connection goes on serving: uvicorn closes it only when an exception escapes the app."""
    core = served.core

    async def broken(prompt):
        raise RuntimeError("tokenizer exploded")

    with httpx.Client(base_url=served.url, timeout=30) as client:
        core.encode_prompts = broken
        try:
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        finally:
            del core.encode_prompts
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "tokenizer exploded" in r.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200
        address = [x.extensions["network_stream"].get_extra_info("client_addr") for x in (r, ok)]
        assert address[0] == address[1]
