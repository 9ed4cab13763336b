"""Which engine, core and gRPC service each pool's workers run: the one place that decides it.

pool -> engine type (`deepinfer_core.roles`) -> worker core -> servicer. The engine class
and what a role demands of its arguments come from the core's role table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_core.roles import EngineType
from proto import worker_pb2_grpc
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_NAMES, POOL_PREFILL
from services.workers.base_core import WorkerCore
from services.workers.decode_core import DecodeCore
from services.workers.prefill_core import PrefillCore
from services.workers.service import DecodeService, PrefillService, WorkerService


@dataclass(frozen=True)
class WorkerRole:
    pool: int
    engine_type: EngineType
    core: type[WorkerCore]
    servicer: type
    """The gRPC servicer over `core`, beside the `Worker` service every worker has."""
    add_servicer: Callable
    """`add_<Service>Servicer_to_server` of the generated module."""
    service_name: str
    """The servicer's full name (for reflection)."""


WORKER_ROLES = {
    POOL_PREFILL: WorkerRole(
        POOL_PREFILL,
        EngineType.PROMPT,
        PrefillCore,
        PrefillService,
        worker_pb2_grpc.add_PrefillServicer_to_server,
        "deepinfer.v1.Prefill",
    ),
    POOL_DECODE: WorkerRole(
        POOL_DECODE,
        EngineType.COMPLETION,
        DecodeCore,
        DecodeService,
        worker_pb2_grpc.add_DecodeServicer_to_server,
        "deepinfer.v1.Decode",
    ),
    POOL_COLOCATED: WorkerRole(
        POOL_COLOCATED,
        EngineType.NORMAL,
        DecodeCore,
        DecodeService,
        worker_pb2_grpc.add_DecodeServicer_to_server,
        "deepinfer.v1.Decode",
    ),
}


def worker_role(pool: int) -> WorkerRole:
    try:
        return WORKER_ROLES[pool]
    except KeyError:
        raise ValueError(f"no worker role for the {POOL_NAMES.get(pool, pool)} pool") from None


def add_services(server, role: WorkerRole, core: WorkerCore) -> list[str]:
    """Register the servicers a worker of `role` answers; returns their full names (for reflection)."""
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(core), server)
    role.add_servicer(role.servicer(core), server)
    return ["deepinfer.v1.Worker", role.service_name]
