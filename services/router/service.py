"""The router's gRPC service: a thin layer over RouterCore and its registry."""

from __future__ import annotations

from typing import Optional

from deepinfer_proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import handles_errors
from services.common.messages import delta_to_proto, info_from_proto, info_to_proto, load_to_proto
from services.common.params import params_from_proto
from services.router.core import RouterCore
from services.router.registry import WorkerHandle


def worker_status(h: WorkerHandle) -> common_pb2.WorkerStatus:
    load = load_to_proto(h.load)
    load.worker_id = h.worker_id
    return common_pb2.WorkerStatus(
        info=info_to_proto(h.info), load=load, state=h.state, inflight=h.inflight, prefix_chunks=len(h.prefixes)
    )


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    @handles_errors
    async def Generate(self, request, context):
        try:
            params = params_from_proto(request.params)
        except ValueError as e:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        stream = self.core.generate(
            request.request_id, list(request.prompt_token_ids), params, request.timeout_s, list(request.images)
        )
        try:
            async for delta in stream:
                yield delta_to_proto(delta)
        finally:
            await stream.aclose()

    async def Register(self, request, context):
        await self.core.registry.add(info_from_proto(request))
        return router_pb2.RegisterReply(accepted=True)

    async def Deregister(self, request, context):
        return router_pb2.DeregisterReply(found=await self.core.registry.remove(request.worker_id))

    @handles_errors
    async def Drain(self, request, context):
        handle = self.core.registry.drain(request.worker_id)
        if handle is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no worker {request.worker_id!r}")
        return worker_status(handle)

    async def Status(self, request, context):
        return cluster_status(self.core, {})


def cluster_status(
    core: RouterCore, targets: dict[int, int], ep_sizes: Optional[dict[int, int]] = None
) -> common_pb2.ClusterStatus:
    """Pools (those with a target or a worker), their workers and load. `ep_sizes`: ranks per
    instance of the pools of expert-parallel instances, whose targets count instances."""
    ep_sizes = ep_sizes or {}
    pools: dict[int, common_pb2.PoolStatus] = {}
    for pool, target in sorted(targets.items()):
        pools[pool] = common_pb2.PoolStatus(pool=pool, target=target, ranks_per_instance=ep_sizes.get(pool, 1))
    for h in sorted(core.registry.workers.values(), key=lambda h: h.worker_id):
        pool = h.info.pool
        status = pools.setdefault(pool, common_pb2.PoolStatus(pool=pool, ranks_per_instance=ep_sizes.get(pool, 1)))
        status.workers.append(worker_status(h))
    ready, detail = core.ready()
    dead = [common_pb2.DeadWorker(worker_id=w, pid=pid) for w, pid in core.registry.recently_dead()]
    return common_pb2.ClusterStatus(
        pools=list(pools.values()), model=core.model, ready=ready, detail=detail, dead_workers=dead
    )
