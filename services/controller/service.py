"""The cluster admin gRPC service (`deepinfer.v1.Cluster`): scale and status.

A head started without workers (`Head.start_front`) has no controller: Status reports the
workers that registered themselves, Scale is refused.
"""

from __future__ import annotations

from typing import Optional

from deepinfer_proto import gateway_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import handles_errors
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_ENCODER, POOL_PREFILL
from services.controller.controller import ClusterController
from services.router.core import RouterCore
from services.router.service import cluster_status


class ClusterService(gateway_pb2_grpc.ClusterServicer):
    def __init__(self, router: RouterCore, check_api_key, controller: Optional[ClusterController] = None):
        self.router = router
        self.check_api_key = check_api_key
        self.controller = controller
        """Set once the head manages pools; None while it only serves the front door."""

    @handles_errors
    async def Scale(self, request, context):
        self.check_api_key(context)
        if self.controller is None:
            raise ServiceError(
                ErrorCode.FAILED_PRECONDITION, "this head manages no pools: its workers register themselves"
            )
        targets = {
            POOL_PREFILL: request.prefill if request.HasField("prefill") else None,
            POOL_DECODE: request.decode if request.HasField("decode") else None,
            POOL_COLOCATED: request.colocated if request.HasField("colocated") else None,
            POOL_ENCODER: request.encoder if request.HasField("encoder") else None,
        }
        await self.controller.scale(targets, request.timeout_s or 600.0)
        return cluster_status(self.router, self.controller.targets, self.controller.spec.ep_sizes)

    @handles_errors
    async def Status(self, request, context):
        self.check_api_key(context)
        if self.controller is None:
            return cluster_status(self.router, {})
        return cluster_status(self.router, self.controller.targets, self.controller.spec.ep_sizes)
