"""The cluster admin gRPC service (`deepinfer.v1.Cluster`): scale and status."""

from __future__ import annotations

from proto import gateway_pb2_grpc
from services.common.grpc_util import handles_errors
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL
from services.controller.controller import ClusterController
from services.router.service import cluster_status


class ClusterService(gateway_pb2_grpc.ClusterServicer):
    def __init__(self, controller: ClusterController, check_api_key):
        self.controller = controller
        self.check_api_key = check_api_key

    @handles_errors
    async def Scale(self, request, context):
        self.check_api_key(context)
        targets = {
            POOL_PREFILL: request.prefill if request.HasField("prefill") else None,
            POOL_DECODE: request.decode if request.HasField("decode") else None,
            POOL_COLOCATED: request.colocated if request.HasField("colocated") else None,
        }
        await self.controller.scale(targets, request.timeout_s or 600.0)
        return cluster_status(self.controller.router, self.controller.targets)

    @handles_errors
    async def Status(self, request, context):
        self.check_api_key(context)
        return cluster_status(self.controller.router, self.controller.targets)
