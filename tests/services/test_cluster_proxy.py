"""`ClusterProxy`: an extra API process passes `deepinfer.v1.Cluster` calls on to the head's service,
with the caller's key, and the head's answer — a status, or an error status — comes back unchanged.
Real gRPC servers on 127.0.0.1: the head's Cluster service over a real (empty) router, the proxy."""

import asyncio

import grpc
import pytest

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import bind, channel, new_server
from services.controller.service import ClusterService
from services.gateway.cluster_proxy import ClusterProxy
from services.gateway.grpc_service import authorization
from services.router.core import RouterCore
from services.router.registry import PoolRegistry

KEY = "k"
TOKEN = "cluster-token"


def _check(context) -> None:
    if authorization(context) != f"Bearer {KEY}":
        raise ServiceError(ErrorCode.UNAUTHENTICATED, "missing or invalid API key")


async def _serve(servicer, cluster_token: str = "") -> tuple[grpc.aio.Server, str]:
    server = new_server(cluster_token=cluster_token)
    gateway_pb2_grpc.add_ClusterServicer_to_server(servicer, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    return server, address


def test_calls_reach_the_head_with_the_callers_key_and_its_errors_come_back():
    async def run():
        router = RouterCore(PoolRegistry(lambda info: None), model="m")
        # the head's router server asks for the cluster token: the proxy sends it beside the caller's key
        head, head_address = await _serve(ClusterService(router, _check), TOKEN)
        proxy = ClusterProxy(head_address, TOKEN)
        front, address = await _serve(proxy)
        try:
            async with channel(address) as ch:
                stub = gateway_pb2_grpc.ClusterStub(ch)
                status = await stub.Status(common_pb2.StatusRequest(), metadata=[("authorization", f"Bearer {KEY}")])
                codes = []
                for call in (
                    stub.Status(common_pb2.StatusRequest()),
                    stub.Scale(gateway_pb2.ScaleRequest(decode=2), metadata=[("authorization", f"Bearer {KEY}")]),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call
                    codes.append((e.value.code(), e.value.details()))
            return status, codes
        finally:
            await front.stop(0)
            await proxy.close()
            await head.stop(0)

    status, codes = asyncio.run(run())
    assert status.model == "m" and not status.ready
    assert codes[0] == (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    assert codes[1][0] == grpc.StatusCode.FAILED_PRECONDITION and "manages no pools" in codes[1][1]
