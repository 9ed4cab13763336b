"""How the gateway reaches the router: over gRPC (the cluster) or in-process (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_proto import common_pb2, router_pb2, router_pb2_grpc
from services.common import auth
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError, code_from_grpc
from services.common.grpc_util import channel, error_from_rpc, retry_after_of
from services.common.messages import delta_from_proto
from services.common.params import params_to_proto


class RouterClient(Protocol):
    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float, images=(), lane=None
    ) -> AsyncIterator[SampleDelta]:
        """`images`: encoded files, one per (expanded) image placeholder run of `prompt`. `lane`: the
        request's fast lane (`services/common/fast_lane.py`), for a router in this process to feed."""
        ...

    async def status(self) -> common_pb2.ClusterStatus: ...


class GrpcRouterClient:
    def __init__(self, address: str, cluster_token: str = ""):
        """`cluster_token`: the router's server asks for it (`services/common/auth.py`)."""
        self._channel = channel(address)
        self._stub = auth.stub(router_pb2_grpc.RouterStub, self._channel, cluster_token)

    async def generate(self, request_id, prompt, params, timeout_s, images=(), lane=None) -> AsyncIterator[SampleDelta]:
        # `lane` is not fed: the router's deltas come over gRPC, read by this stream
        req = router_pb2.RouteRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            timeout_s=timeout_s,
            images=list(images),
        )
        call = self._stub.Generate(req, timeout=timeout_s + 5 if timeout_s else None)
        try:
            async for msg in call:
                yield delta_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    async def status(self) -> common_pb2.ClusterStatus:
        try:
            return await self._stub.Status(common_pb2.StatusRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, "the router") from None

    async def close(self) -> None:
        await self._channel.close()


def _error(e: grpc.aio.AioRpcError) -> ServiceError:
    """The router's own status passes through (it names the stage at fault); a transport
    failure names the router."""
    details = e.details() or e.code().name
    if e.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:
        return ServiceError(ErrorCode.UNAVAILABLE, f"the router is unreachable: {details}")
    return ServiceError(code_from_grpc(e.code()), details, retry_after_s=retry_after_of(e))  # e.g. a pool is empty


class LocalRouterClient:
    """A RouterCore in this process."""

    def __init__(self, core):
        self.core = core

    def generate(self, request_id, prompt, params, timeout_s, images=(), lane=None) -> AsyncIterator[SampleDelta]:
        return self.core.generate(request_id, prompt, params, timeout_s, images, lane)

    async def status(self) -> common_pb2.ClusterStatus:
        from services.router.service import cluster_status

        return cluster_status(self.core, {})

    async def close(self) -> None:
        pass
