"""Which engine, core and gRPC service each pool's workers run: the one place that decides it.

pool -> engine type (`deepinfer_core.roles`) -> worker core -> servicer. The engine class
and what a role demands of its arguments come from the core's role table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from deepinfer_core.roles import EngineType
from deepinfer_proto import worker_pb2_grpc
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_ENCODER, POOL_NAMES, POOL_PREFILL
from services.workers.decode_core import DecodeCore
from services.workers.encoder_core import EncoderCore
from services.workers.prefill_core import PrefillCore
from services.workers.service import DecodeService, EncoderService, PrefillService, WorkerService


@dataclass(frozen=True)
class WorkerRole:
    pool: int
    engine_type: Optional[EngineType]
    """None: the pool runs no language model (vision encoders)."""
    core: type
    servicer: type
    """The gRPC servicer over `core`, beside the `Worker` service every worker has."""
    add_servicer: Callable
    """`add_<Service>Servicer_to_server` of the generated module."""
    service_name: str
    """The servicer's full name (for reflection)."""

    def make_core(self, engine, spec):
        """The role's core over `engine`; a streaming one (CE, NORMAL) sends deltas at the spec's interval."""
        if self.core is DecodeCore:
            return DecodeCore(engine, spec.worker_id, stream_interval=spec.stream_interval)
        return self.core(engine, spec.worker_id)


WORKER_ROLES = {
    POOL_ENCODER: WorkerRole(
        POOL_ENCODER,
        None,
        EncoderCore,
        EncoderService,
        worker_pb2_grpc.add_EncoderServicer_to_server,
        "deepinfer.v1.Encoder",
    ),
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


def add_services(server, role: WorkerRole, core) -> list[str]:
    """Register the servicers a worker of `role` answers; returns their full names (for reflection)."""
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(core), server)
    role.add_servicer(role.servicer(core), server)
    return ["deepinfer.v1.Worker", role.service_name]
