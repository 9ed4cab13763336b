"""300 clients that leave at random points (HTTP and gRPC, a third within the first 30 ms: before the
headers, during the reservation, the prefill or the KV transfer; the rest mid-stream): afterwards no
stage holds anything (router in-flight counts, engine requests, reservations, KV blocks, open
streams) and the next request succeeds. A reused gRPC request id does not disturb the first."""

import asyncio
import random
import time

import grpc
import httpx

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.faults import complete, wait_at_rest

CANCELLATIONS = 300
AT_ONCE = 24


async def _http(url: str, client: httpx.AsyncClient, i: int, delay: float) -> None:
    body = {"prompt": f"cancel me {i} " * (1 + i % 7), "max_tokens": 200, "stream": i % 5 != 0, "ignore_eos": True}

    async def read():
        async with client.stream("POST", f"{url}/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    try:
        await asyncio.wait_for(read(), delay)  # cut off: the connection is dropped mid-request
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass


async def _grpc(stub, i: int, delay: float) -> None:
    params = common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    call = stub.Generate(gateway_pb2.GenerateRequest(text=f"cancel me {i} " * (1 + i % 5), params=params))

    async def read():
        async for _ in call:
            pass

    try:
        await asyncio.wait_for(read(), delay)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
    call.cancel()


async def _cancel_all(cluster) -> None:
    rng = random.Random(28)
    gate = asyncio.Semaphore(AT_ONCE)
    limits = httpx.Limits(max_connections=AT_ONCE * 2)
    async with (
        httpx.AsyncClient(timeout=60, limits=limits) as client,
        grpc.aio.insecure_channel(cluster.grpc_address) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(i: int):
            delay = rng.uniform(0.0, 0.03) if i % 3 == 0 else rng.uniform(0.03, 1.5)
            async with gate:
                if i % 2:
                    await _grpc(stub, i, delay)
                else:
                    await _http(cluster.base_url, client, i, delay)

        await asyncio.gather(*(one(i) for i in range(CANCELLATIONS)))


def test_three_hundred_cancellations_leave_every_stage_at_rest(cluster):
    asyncio.run(asyncio.wait_for(_cancel_all(cluster), 600))
    began = time.monotonic()
    view = wait_at_rest(cluster, timeout_s=90)
    print(f"at rest {time.monotonic() - began:.1f}s after the last cancellation")
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view
    assert complete(cluster, "after the storm", 5, ignore_eos=True)["finish_reason"] == "length"


def test_a_reused_request_id_does_not_disturb_the_first(cluster):
    async def run():
        async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

            async def one(prompt: str) -> list[int]:
                req = gateway_pb2.GenerateRequest(request_id="same-id", text=prompt, params=params)
                return [t async for r in stub.Generate(req, timeout=120) for t in r.delta.token_ids]

            return await asyncio.gather(one("the first one"), one("the second one"))

    first, second = asyncio.run(run())
    assert len(first) == 40 and len(second) == 40
    view = wait_at_rest(cluster, timeout_s=60)
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view
