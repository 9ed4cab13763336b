"""`deepinfer serve --api-workers 2`: two API processes behind one HTTP port and one gRPC port.

Each new connection is a new client port, which the kernel hashes to one of the processes; the
`x-deepinfer-process` header names the one that answered. Both serve, /metrics from either counts
the requests of both, both check the API key, the concurrency limit counts both together, and a
process that dies is logged and started again with its count of requests zeroed.
"""

import contextlib
import os
import signal
from collections import Counter

import grpc
import httpx
import pytest

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.front import PROCESS_HEADER
from tests.helpers.cluster import ServeProcess, metric_value, wait_until

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = [("authorization", f"Bearer {KEY}")]
LIMIT = 3
BODY = {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}
LONG = {"prompt": "a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
"""A stream that stays in flight for seconds: 2,000 decode steps (the context is 4,096)."""
ENGINE = ["--num-blocks", "512", "--block-size", "16", "--max-model-len", "4096"]


@pytest.fixture(scope="module")
def serve(cluster):
    args = ["--ray-address", cluster.ray_address, "--colocated", "--api-workers", "2", "--api-key", KEY]
    s = ServeProcess(*args, "--max-concurrent-requests", str(LIMIT), *ENGINE)
    yield s
    s.stop()


def _on_each_process(send, attempts: int = 40) -> dict[int, list[httpx.Response]]:
    """Call `send()` (one request on a new connection) until both processes answered twice."""
    answers: dict[int, list[httpx.Response]] = {0: [], 1: []}
    for _ in range(attempts):
        r = send()
        answers[int(r.headers[PROCESS_HEADER])].append(r)
        if all(len(v) >= 2 for v in answers.values()):
            return answers
    raise AssertionError(f"in {attempts} connections a process never answered twice: {answers}")


def _admitted(text: str) -> dict[int, float]:
    return {
        p: metric_value(text, "deepinfer:api_process_requests_total", process=p, outcome="admitted") for p in (0, 1)
    }


def test_both_processes_serve_and_metrics_from_either_count_both(serve):
    before = httpx.get(f"{serve.url}/metrics", timeout=10).text
    answers = _on_each_process(lambda: httpx.post(f"{serve.base_url}/completions", json=BODY, headers=AUTH, timeout=60))
    assert {r.status_code for v in answers.values() for r in v} == {200}
    texts = {r.json()["choices"][0]["text"] for v in answers.values() for r in v}
    assert len(texts) == 1  # greedy: one model, whichever process routed it
    scrapes = _on_each_process(lambda: httpx.get(f"{serve.url}/metrics", timeout=10))
    sent = sum(len(v) for v in answers.values())
    for text in (r.text for v in scrapes.values() for r in v):
        gained = {p: n - _admitted(before)[p] for p, n in _admitted(text).items()}
        assert gained == {p: len(v) for p, v in answers.items()}, gained
        latency = "deepinfer:e2e_request_latency_seconds_count"
        assert metric_value(text, latency) - metric_value(before, latency) == sent
        assert text.count('deepinfer:kv_cache_usage_perc{role="colocated"') == 1  # the worker's load, once


def test_every_process_checks_the_api_key_and_serves_health_and_models(serve):
    refused = _on_each_process(lambda: httpx.post(f"{serve.base_url}/completions", json=BODY, timeout=60))
    assert {r.status_code for v in refused.values() for r in v} == {401}
    models = _on_each_process(lambda: httpx.get(f"{serve.base_url}/models", headers=AUTH, timeout=10))
    assert {r.json()["data"][0]["id"] for v in models.values() for r in v} == {"deepinfer-tiny"}
    health = _on_each_process(lambda: httpx.get(f"{serve.url}/health", timeout=10))
    assert {r.status_code for v in health.values() for r in v} == {200}


def test_the_grpc_port_is_shared_and_every_call_is_served(serve):
    port = int(serve.grpc_address.rsplit(":", 1)[1])
    assert _listeners(port) >= set(serve.api_pids().values())
    request = gateway_pb2.GenerateRequest(text="Hello", params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(4):  # a channel per call: a new connection each time
        with grpc.insecure_channel(serve.grpc_address) as ch:
            replies = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request, metadata=GRPC_AUTH, timeout=60))
            assert replies[-1].usage.completion_tokens == 3
            cluster = gateway_pb2_grpc.ClusterStub(ch)
            status = cluster.Status(common_pb2.StatusRequest(), metadata=GRPC_AUTH, timeout=10)
            assert status.ready and [w.info.worker_id for p in status.pools for w in p.workers] == ["colocated-0"]
            with pytest.raises(grpc.RpcError) as e:
                cluster.Status(common_pb2.StatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_concurrency_limit_counts_both_processes(serve):
    with contextlib.ExitStack() as streams:
        holders = [_open_stream(streams, serve) for _ in range(LIMIT)]
        assert all(r.status_code == 200 for r in holders), [r.status_code for r in holders]
        refused = _on_each_process(
            lambda: httpx.post(f"{serve.base_url}/completions", json=BODY, headers=AUTH, timeout=60)
        )
        assert {r.status_code for v in refused.values() for r in v} == {429}
        assert all(f"limit {LIMIT}" in r.json()["error"]["message"] for v in refused.values() for r in v)
        held = Counter(int(r.headers[PROCESS_HEADER]) for r in holders)
        # both refused, and at most one holds LIMIT streams itself: the other counted the first's
        assert [p for p in (0, 1) if held[p] < LIMIT and refused[p]], held
    assert wait_until(lambda: _completion_status(serve) == 200, timeout_s=30)  # the streams let go when closed


def test_a_dead_api_process_is_logged_restarted_and_its_requests_no_longer_counted(serve):
    with contextlib.ExitStack() as streams:
        held = _stream_on_process(streams, serve, 1)
        pid = serve.api_pids()[1]
        os.kill(pid, signal.SIGKILL)
        assert serve.wait_for_output(rf"API process 1 \(pid {pid}\) exited with code -9", timeout_s=30)
        assert wait_until(lambda: serve.api_pids()[1] != pid, timeout_s=90), "API process 1 was not started again"
        assert held.status_code == 200
    with contextlib.ExitStack() as streams:
        assert all(_open_stream(streams, serve).status_code == 200 for _ in range(LIMIT))  # its count was zeroed
    answers = _on_each_process(lambda: httpx.post(f"{serve.base_url}/completions", json=BODY, headers=AUTH, timeout=60))
    assert {r.status_code for v in answers.values() for r in v} == {200}


def _open_stream(stack: contextlib.ExitStack, serve) -> httpx.Response:
    client = stack.enter_context(httpx.Client(timeout=60))
    return stack.enter_context(client.stream("POST", f"{serve.base_url}/completions", json=LONG, headers=AUTH))


def _stream_on_process(stack: contextlib.ExitStack, serve, process: int, attempts: int = 40) -> httpx.Response:
    """A long stream that process `process` admitted (those others took are closed again)."""
    for _ in range(attempts):
        inner = contextlib.ExitStack()
        r = _open_stream(inner, serve)
        if r.headers[PROCESS_HEADER] == str(process):
            stack.enter_context(inner)
            return r
        inner.close()
    raise AssertionError(f"no stream reached process {process} in {attempts} connections")


def _completion_status(serve) -> int:
    return httpx.post(f"{serve.base_url}/completions", json=BODY, headers=AUTH, timeout=60).status_code


def _listeners(port: int) -> set[int]:
    """Pids with a listening TCP socket on `port` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                    inodes.add(cols[9])
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(pid))
    return pids
