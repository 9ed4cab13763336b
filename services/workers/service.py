"""gRPC servicers of a worker: thin layers over its core (`*_core.py`)."""

from __future__ import annotations

from proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import handles_errors
from services.common.messages import delta_to_proto, load_to_proto, region_from_proto
from services.common.params import params_from_proto
from services.workers.base_core import WorkerCore


def _params(request):
    try:
        return params_from_proto(request.params)
    except ValueError as e:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, core):
        self.core = core

    @handles_errors
    async def Prefill(self, request, context):
        r = await self.core.prefill(
            request.request_id, list(request.prompt_token_ids), _params(request), request.kv_target
        )
        return worker_pb2.PrefillReply(
            first=delta_to_proto(r.first),
            kv_bytes=r.kv_bytes,
            kv_seconds=r.kv_seconds,
            queue_seconds=r.queue_seconds,
            kv_exposed_seconds=r.kv_exposed_seconds,
        )

    @handles_errors
    async def Abort(self, request, context):
        return worker_pb2.AbortReply(found=await self.core.abort(request.request_id))

    @handles_errors
    async def ConnectPeer(self, request, context):
        await self.core.connect_peer(request.agent_name, request.agent_metadata, region_from_proto(request, "region"))
        return worker_pb2.ConnectPeerReply()


class DecodeService(worker_pb2_grpc.DecodeServicer):
    """CE (Reserve / Stream / Abort) or NORMAL engine (Generate / Abort)."""

    def __init__(self, core):
        self.core = core

    @handles_errors
    async def Reserve(self, request, context):
        target = await self.core.reserve(
            request.request_id, list(request.prompt_token_ids), _params(request), request.lease_s or 30.0
        )
        return worker_pb2.ReserveReply(kv_target=target)

    @handles_errors
    async def Stream(self, request, context):
        async for delta in self.core.stream(request.request_id):
            yield delta_to_proto(delta)

    @handles_errors
    async def Generate(self, request, context):
        async for delta in self.core.generate(request.request_id, list(request.prompt_token_ids), _params(request)):
            yield delta_to_proto(delta)

    @handles_errors
    async def Abort(self, request, context):
        return worker_pb2.AbortReply(found=await self.core.abort(request.request_id))


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore):
        self.core = core

    async def Stats(self, request, context) -> common_pb2.WorkerLoad:
        return load_to_proto(self.core.stats())

    async def Health(self, request, context):
        ok, detail = self.core.health()
        return worker_pb2.HealthReply(ok=ok, detail=detail)

    async def Drain(self, request, context):
        return worker_pb2.DrainReply(requests=self.core.drain())


def add_services(server, core: WorkerCore) -> list[str]:
    """Register the servicers this core answers; returns their full names (for reflection)."""
    from services.workers.prefill_core import PrefillCore

    names = ["deepinfer.v1.Worker"]
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(core), server)
    if isinstance(core, PrefillCore):
        worker_pb2_grpc.add_PrefillServicer_to_server(PrefillService(core), server)
        names.append("deepinfer.v1.Prefill")
    else:
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeService(core), server)
        names.append("deepinfer.v1.Decode")
    return names
