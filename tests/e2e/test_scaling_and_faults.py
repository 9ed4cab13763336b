"""`deepinfer scale` up and down while requests stream (none lost, pools report the new sizes),
and stage failures: a dead PE is retried around and replaced, a dead CE's streams migrate."""

import os
import signal

import grpc
import httpx
import pytest

from deepinfer_proto import common_pb2, gateway_pb2_grpc
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, wait_until
from tests.helpers.faults import Streams


@pytest.fixture(scope="module")
def serve(cluster):
    # its own workers on the shared Ray; text only: no vision encoder to count in the pool sizes
    s = ServeProcess("--ray-address", cluster.ray_address, "--encoder", "0", *SMALL_ENGINE)
    yield s
    s.stop()


def _status(serve) -> common_pb2.ClusterStatus:
    with grpc.insecure_channel(serve.grpc_address) as ch:
        return gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)


def _pool_sizes(serve) -> dict[int, int]:
    return {p.pool: len(p.workers) for p in _status(serve).pools}


def _streams(serve, count: int, max_tokens: int) -> Streams:
    return Streams(serve, ["scale me"] * count, max_tokens, ignore_eos=True)


def test_scale_up_and_down_while_streaming_loses_nothing(serve):
    streams = _streams(serve, 8, max_tokens=200)
    r = serve.cli("scale", "--prefill", "2", "--decode", "2")
    assert r.returncode == 0, r.stderr
    assert "prefill pool: 2 worker(s), target 2" in r.stdout and "decode pool: 2 worker(s), target 2" in r.stdout
    more = _streams(serve, 8, max_tokens=200)  # spread over the new workers too
    wait_until(lambda: sum(w.inflight for p in _status(serve).pools for w in p.workers if p.pool == 3) >= 8, 30)
    r = serve.cli("scale", "--prefill", "1", "--decode", "1")  # drains while streams are running
    assert r.returncode == 0, r.stderr
    assert _pool_sizes(serve) == {2: 1, 3: 1}
    for reasons, errors in streams.join() + more.join():
        assert errors == [] and reasons == ["length"]
    r = serve.cli("status")
    assert r.returncode == 0 and "prefill pool: 1 worker(s), target 1" in r.stdout


def test_a_dead_prefill_engine_is_routed_around_and_replaced(serve):
    assert serve.cli("scale", "--prefill", "2").returncode == 0
    prefill = next(p for p in _status(serve).pools if p.pool == 2)
    victim = prefill.workers[-1].info
    os.kill(victim.pid, signal.SIGKILL)
    for i in range(6):  # some of these may pick the dead PE before it is out of routing
        r = httpx.post(
            f"{serve.base_url}/completions",
            json={"prompt": f"retry {i}", "max_tokens": 4, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

    def replaced() -> bool:
        ids = [w.info.worker_id for p in _status(serve).pools if p.pool == 2 for w in p.workers]
        return len(ids) == 2 and victim.worker_id not in ids

    assert wait_until(replaced, timeout_s=120)  # the pool heals to its target
    assert serve.cli("scale", "--prefill", "1").returncode == 0


def test_a_dead_decode_engine_s_streams_migrate_and_finish(serve):
    assert serve.cli("scale", "--decode", "2").returncode == 0
    streams = _streams(serve, 4, max_tokens=400)
    assert wait_until(lambda: min(streams.chunks) >= 2, timeout_s=120)  # all four are decoding
    decode = next(p for p in _status(serve).pools if p.pool == 3)
    victim = max(decode.workers, key=lambda w: w.inflight)
    os.kill(victim.info.pid, signal.SIGKILL)
    results = streams.join()
    assert all(errors == [] and reasons == ["length"] for reasons, errors in results), results
    r = httpx.post(f"{serve.base_url}/completions", json={"prompt": "still here", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert serve.cli("scale", "--decode", "1").returncode == 0


def test_health_is_503_while_a_pool_has_no_ready_worker(serve):
    assert serve.cli("scale", "--prefill", "0").returncode == 0
    r = httpx.get(f"{serve.url}/health", timeout=10)
    assert r.status_code == 503 and "prefill" in r.json()["detail"]
    assert serve.cli("scale", "--prefill", "1").returncode == 0
    assert httpx.get(f"{serve.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{serve.base_url}/completions", json={"prompt": "back", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
