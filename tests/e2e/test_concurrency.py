"""Many streams at once all complete; a client that leaves mid-stream frees its KV on both engines."""

import asyncio
import time

import grpc
import httpx
import openai

from deepinfer_proto import common_pb2, gateway_pb2_grpc, worker_pb2_grpc
from services.common.auth import token_metadata
from tests.helpers.cluster import wait_until


def _workers(cluster) -> dict[str, str]:
    """pool name -> worker address."""
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        status = gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
    names = {1: "encoder", 2: "prefill", 3: "decode"}
    return {names[p.pool]: w.info.address for p in status.pools for w in p.workers}


def _stats(address: str, cluster) -> common_pb2.WorkerLoad:
    """A worker's own report (an internal service: the call carries the cluster token)."""
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return stub.Stats(common_pb2.StatusRequest(), timeout=10, metadata=token_metadata(cluster.cluster_token))


def test_thirty_two_concurrent_streams_all_complete(cluster):
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[int, str]:
        stream = await client.completions.create(
            model="deepinfer-tiny",
            prompt=f"request number {i} says",
            max_tokens=16,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        reasons = []
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        return len(reasons), reasons[-1]

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run_all())
    assert results == [(1, "length")] * 32


def _leave_mid_stream(cluster, workers, free0) -> bool:
    """Read three events of a long stream, then leave it if the CE holds the request (True). On a
    loaded machine the CE can finish all 400 tokens before the client has read three events: then
    the rest of the stream must be the whole answer (it ends by length, no error) and nothing was
    left mid-stream (False)."""
    body = {"prompt": "a long story " * 20, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.base_url}/completions", json=body, timeout=60) as r:
        seen: list[str] = []
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                seen.append(line)
            if len(seen) >= 3:
                break
        assert not any('"error"' in line for line in seen), seen  # a failed request would explain the rest
        ce = _stats(workers["decode"], cluster)
        if ce.requests == 1 and ce.free_blocks < free0["decode"]:  # the request holds KV on the CE
            return True
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest and rest[-1] == "data: [DONE]", (ce, seen, rest[-3:])
        assert '"finish_reason": "length"' in rest[-2], (ce, rest[-3:])
        return False


def test_client_disconnect_mid_stream_frees_kv_on_prefill_and_decode(cluster):
    workers = _workers(cluster)
    free0 = {pool: _stats(addr, cluster).free_blocks for pool, addr in workers.items()}
    assert any(_leave_mid_stream(cluster, workers, free0) for _ in range(3)), "the CE never held the request"
    started = time.monotonic()
    assert wait_until(lambda: _stats(workers["decode"], cluster).requests == 0, timeout_s=30), (
        "the CE still holds the request"
    )
    assert wait_until(lambda: _stats(workers["decode"], cluster).free_blocks == free0["decode"], timeout_s=30)
    assert time.monotonic() - started < 30
    pe = _stats(workers["prefill"], cluster)
    assert pe.requests == 0 and pe.free_blocks == free0["prefill"]


def test_client_disconnect_while_waiting_for_a_non_streamed_answer(cluster):
    workers = _workers(cluster)
    free0 = _stats(workers["decode"], cluster).free_blocks
    body = {"prompt": "wait for me", "max_tokens": 450, "ignore_eos": True}
    try:
        httpx.post(f"{cluster.base_url}/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    assert wait_until(lambda: _stats(workers["decode"], cluster).requests == 0, timeout_s=30)
    assert wait_until(lambda: _stats(workers["decode"], cluster).free_blocks == free0, timeout_s=30)
