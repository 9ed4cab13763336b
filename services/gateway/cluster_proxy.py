"""`deepinfer.v1.Cluster` in an extra API process: passed on to the head, which holds the controller.

The gRPC port is shared by every API process, so `deepinfer scale` / `status` may reach any of them;
the head serves the same service beside its router (`Head.router_address`). The caller's metadata
goes along, so the head checks the API key.
"""

from __future__ import annotations

import grpc

from deepinfer_proto import gateway_pb2_grpc
from services.common import auth
from services.common.grpc_util import channel

_STATUS_TIMEOUT_S = 10.0


class ClusterProxy(gateway_pb2_grpc.ClusterServicer):
    def __init__(self, head_address: str, cluster_token: str = ""):
        """`cluster_token`: the head's router server asks for it; the caller's API key goes along."""
        self._channel = channel(head_address)
        self._stub = auth.stub(gateway_pb2_grpc.ClusterStub, self._channel, cluster_token)

    async def Scale(self, request, context):
        timeout = (request.timeout_s or 600.0) + 30.0  # the head's own deadline runs out first
        return await self._forward(self._stub.Scale, request, context, timeout)

    async def Status(self, request, context):
        return await self._forward(self._stub.Status, request, context, _STATUS_TIMEOUT_S)

    async def _forward(self, method, request, context, timeout: float):
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        try:
            return await method(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or e.code().name)

    async def close(self) -> None:
        await self._channel.close()
