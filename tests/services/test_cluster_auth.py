"""The cluster token on the internal gRPC servers: the head's router server (where workers register)
and a worker's server refuse every call without it or with another one (UNAUTHENTICATED), serve it
with the token, and describe themselves (reflection) only when asked to. The worker registered with
the token and the router sends it to the worker: a completion through the gateway goes through.
A front-only head (`Head.start_front`) and a real colocated worker on 127.0.0.1."""

import asyncio
import threading

import grpc
import httpx
import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from deepinfer_proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from services.common.auth import TOKEN_KEY  # noqa: E402
from services.common.workers import POOL_COLOCATED  # noqa: E402
from services.controller.head import Head  # noqa: E402
from services.controller.serve_config import HeadConfig  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import WorkerServer  # noqa: E402

ARGS = EngineSettings(device="cpu", num_gpu_blocks=64, max_model_len=128, block_size=8)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


class Cluster:
    def __init__(self):
        self.config = HeadConfig(port=0, grpc_port=0, colocated=True, engine_args=ARGS)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.head = Head(self.config)
        self._run(self.head.start_front())
        spec = WorkerSpec(
            "normal-0",
            POOL_COLOCATED,
            ARGS,
            router_address=self.head.router_address,
            cluster_token=self.config.cluster_token,
            metrics=False,
        )
        self.worker = WorkerServer(spec)
        self.worker.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def stop(self) -> None:
        self.worker.stop()
        self._run(self.head.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


def _codes(address: str, calls, metadata) -> list:
    """The status code of each `(stub class, method, request)` call (OK when it answered)."""
    codes = []
    with grpc.insecure_channel(address) as ch:
        for stub_class, method, request in calls:
            call = getattr(stub_class(ch), method)
            try:
                reply = call(request, timeout=10, metadata=metadata)
                if not hasattr(reply, "ByteSize"):
                    list(reply)  # a stream: read it to its status
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    return codes


ROUTER_CALLS = [
    (router_pb2_grpc.RouterStub, "Status", common_pb2.StatusRequest()),
    (router_pb2_grpc.RouterStub, "Register", common_pb2.WorkerInfo(worker_id="intruder", address="127.0.0.1:1")),
    (router_pb2_grpc.RouterStub, "Deregister", router_pb2.DeregisterRequest(worker_id="normal-0")),
    (router_pb2_grpc.RouterStub, "Drain", router_pb2.DeregisterRequest(worker_id="normal-0")),
    (
        router_pb2_grpc.RouterStub,
        "Generate",
        router_pb2.RouteRequest(prompt_token_ids=[1, 2], params=common_pb2.SamplingParams(max_tokens=2)),
    ),
]
WORKER_CALLS = [
    (worker_pb2_grpc.WorkerStub, "Stats", common_pb2.StatusRequest()),
    (worker_pb2_grpc.WorkerStub, "Health", worker_pb2.HealthRequest()),
    (worker_pb2_grpc.WorkerStub, "Drain", worker_pb2.DrainRequest()),
    (
        worker_pb2_grpc.DecodeStub,
        "Generate",
        worker_pb2.GenerateWork(request_id="x", prompt_token_ids=[1], params=common_pb2.SamplingParams(max_tokens=2)),
    ),
    (worker_pb2_grpc.DecodeStub, "Subscribe", worker_pb2.SubscribeRequest(subscriber_id="s")),
    (
        worker_pb2_grpc.DecodeStub,
        "SubmitBatch",
        worker_pb2.SubmitBatchRequest(works=[worker_pb2.GenerateWork(request_id="x", prompt_token_ids=[1])]),
    ),
]


@pytest.mark.parametrize("metadata", [(), ((TOKEN_KEY, "not-the-token"),), (("authorization", "Bearer x"),)])
def test_internal_calls_without_the_cluster_token_are_refused(cluster, metadata):
    assert _codes(cluster.head.router_address, ROUTER_CALLS, metadata) == [UNAUTHENTICATED] * len(ROUTER_CALLS)
    assert _codes(cluster.worker.info.address, WORKER_CALLS, metadata) == [UNAUTHENTICATED] * len(WORKER_CALLS)
    assert list(cluster.head.router.registry.workers) == ["normal-0"]  # no intruder, nothing drained
    assert cluster.head.router.registry.workers["normal-0"].state == "ready"


def test_with_the_token_they_are_served_and_the_gateway_reaches_the_worker(cluster):
    token = ((TOKEN_KEY, cluster.config.cluster_token),)
    with grpc.insecure_channel(cluster.head.router_address) as ch:
        status = router_pb2_grpc.RouterStub(ch).Status(common_pb2.StatusRequest(), timeout=10, metadata=token)
    assert [w.info.worker_id for p in status.pools for w in p.workers] == ["normal-0"]  # it registered with the token
    with grpc.insecure_channel(cluster.worker.info.address) as ch:
        health = worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=10, metadata=token)
    assert health.ok
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    reply = httpx.post(f"{cluster.head.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_internal_servers_serve_no_reflection_by_default(cluster):
    token = ((TOKEN_KEY, cluster.config.cluster_token),)
    for address in (cluster.head.router_address, cluster.worker.info.address):
        with grpc.insecure_channel(address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as e:
                list(stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=token))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_when_turned_on_needs_the_token_too():
    from services.common.grpc_util import bind, enable_reflection, new_server

    async def run():
        server = new_server(cluster_token="t")
        enable_reflection(server, [])
        address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
        await server.start()
        try:
            return [await _reflect(address, metadata) for metadata in ((), ((TOKEN_KEY, "t"),))]
        finally:
            await server.stop(0)

    refused, served = asyncio.run(run())
    assert refused == UNAUTHENTICATED
    assert "grpc.reflection.v1alpha.ServerReflection" in served


async def _reflect(address: str, metadata):
    """The services a reflection call lists, or the code it failed with (a bidirectional stream)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata):
                return [s.name for s in reply.list_services_response.service]
        except grpc.aio.AioRpcError as e:
            return e.code()
