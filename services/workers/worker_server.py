"""One worker process: build the engine, serve it over gRPC, register with the router.

An asyncio loop (uvloop) on a thread of its own runs the gRPC server and the core; the
engine runs on the host's thread. In the cluster a `WorkerActor` (a Ray actor) holds the
server; tests and benchmarks may run a `WorkerServer` directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from typing import Optional

from deepinfer_core.roles import engine_class
from services.common.gc_tuning import freeze_startup_heap
from services.common.grpc_util import bind, channel, enable_reflection, new_event_loop, new_server
from services.common.workers import POOL_NAMES, WorkerInfo, WorkerLoad
from services.workers.roles import add_services, worker_role
from services.workers.spec import InstanceRank, WorkerSpec

logger = logging.getLogger(__name__)


def build_engine(spec: WorkerSpec):
    """The engine of the spec's pool, built from its settings (a vision encoder's runner for the
    encoder pool); a rank of an instance joins its peers first (TimeoutError naming a rank that never came)."""
    engine_type = worker_role(spec.pool).engine_type
    if engine_type is None:
        from deepinfer_core.multimodal.encoder_runner import VisionEncoderRunner
        from deepinfer_core.roles import EngineType

        args = spec.engine_args.to_engine_args(EngineType.PROMPT)  # the model's settings; no engine is built
        device = args.resolve_device()
        return VisionEncoderRunner.from_model_config(args.create_model_config(device), device, spec.encoder)
    args = spec.engine_args.to_engine_args(engine_type, spec.instance)
    if spec.instance is None:
        return engine_class(engine_type).from_engine_args(args)
    from deepinfer_core.distributed.group import join_instance

    inst = spec.instance
    backend = "nccl" if args.resolve_device().startswith("cuda") else "gloo"
    group = join_instance(inst.rank, inst.size, inst.address, backend, inst.join_timeout_s, inst.collective_timeout_s)
    return engine_class(engine_type).from_engine_args(args, group=group)


def encoder_info(spec: WorkerSpec, address: str) -> WorkerInfo:
    """What a vision encoder registers with (no KV, no engine role: its handles name its agent)."""
    return WorkerInfo(
        worker_id=spec.worker_id, pool=spec.pool, engine_type=0, address=address, model=spec.model_name, pid=os.getpid()
    )


def worker_info(spec: WorkerSpec, engine, address: str) -> WorkerInfo:
    """What the worker registers with. Reads the engine's load: call before its thread starts."""
    agent, config = engine.agent, engine.config
    return WorkerInfo(
        worker_id=spec.worker_id,
        pool=spec.pool,
        engine_type=engine.engine_type.value,
        address=address,
        agent_name=agent.name if agent is not None else "",
        agent_metadata=agent.metadata if agent is not None else b"",
        model=spec.model_name,
        max_model_len=config.scheduler.max_model_len,
        block_size=config.cache.block_size,
        num_blocks=engine.load().num_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        pid=os.getpid(),
        kv_region=agent.region if agent is not None else None,
    )


class WorkerServer:
    """`engine`: a pre-built engine (or anything with the engine's host surface: `name`,
    `engine_type`, `config`, `agent`, `step`, `has_unfinished_requests`, `poll_handoffs`,
    `pop_handoff_results`, `awaits_handoffs`, `load`, `abort_request` and the role's admission
    call); None builds one from `spec.engine_args` in `start()`."""

    def __init__(self, spec: WorkerSpec, engine=None):
        self.spec = spec
        self.role = worker_role(spec.pool)
        self.engine = engine
        self.info: Optional[WorkerInfo] = None
        self.core = None
        self._server = None
        self._metrics_server = None
        self.loop = new_event_loop()
        self.stopped = threading.Event()
        """Set once `stop` has run (what `WorkerActor.watch` waits for)."""
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"loop-{spec.worker_id}", daemon=True)

    def start(self, timeout_s: float = 600.0) -> WorkerInfo:
        """Build the engine (unless given), start serving, register; returns once the router has the worker."""
        if self.spec.torch_threads:
            import torch

            torch.set_num_threads(self.spec.torch_threads)
        if self.engine is None:
            self.engine = build_engine(self.spec)
        if self.role.engine_type is not None and self.engine.engine_type != self.role.engine_type:
            raise ValueError(
                f"a {POOL_NAMES[self.spec.pool]} worker needs a {self.role.engine_type.name} engine, "
                f"got {self.engine.engine_type.name}"
            )
        self._thread.start()
        self.info = self._run(self._serve(self.engine), timeout_s)
        if self.spec.router_address:
            self._run(self._register(), 60.0)
        return self.info

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _serve(self, engine) -> WorkerInfo:
        spec = self.spec
        # before the engine thread starts
        info = worker_info(spec, engine, "") if self.role.engine_type is not None else encoder_info(spec, "")
        self.core = self.role.make_core(engine, spec)
        self.core.start()
        self._server = new_server(cluster_token=spec.cluster_token, kind=spec.grpc_server)
        services = add_services(self._server, self.role, self.core)
        if spec.reflection:
            enable_reflection(self._server, services)
        port = bind(self._server, spec.host, spec.port)
        await self._server.start()
        metrics_address = self._start_metrics() if spec.metrics else ""
        return dataclasses.replace(info, address=f"{spec.host}:{port}", metrics_address=metrics_address)

    def _start_metrics(self) -> str:
        from prometheus_client import start_http_server

        from services.metrics.load_collector import add_load_source

        role = POOL_NAMES[self.spec.pool]
        add_load_source(lambda: [(role, self.spec.worker_id, self.core.stats())])
        self._metrics_server, _ = start_http_server(0, addr=self.spec.host)
        return f"{self.spec.host}:{self._metrics_server.server_port}"

    async def _register(self) -> None:
        from deepinfer_proto import router_pb2_grpc
        from services.common import auth
        from services.common.messages import info_to_proto

        async with channel(self.spec.router_address) as ch:
            router = auth.stub(router_pb2_grpc.RouterStub, ch, self.spec.cluster_token)
            await router.Register(info_to_proto(self.info), timeout=60)

    # ---- control (any thread) ----------------------------------------------------------------
    def drain(self) -> int:
        return self.core.drain()

    def stats(self) -> WorkerLoad:
        return self.core.stats()

    def stop(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            self.loop.call_soon_threadsafe(self.core.end_subscriptions)  # else the grace waits for them
            self._run(self._server.stop(grace_s), grace_s + 5)
        if self.core is not None:
            self.core.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.stopped.set()


class WorkerActor:
    """The Ray actor of one worker (one engine process of the cluster): the controller creates
    it with `ray.remote(WorkerActor).options(...)`; `start()` builds and serves the engine and
    registers with the router."""

    def __init__(self, spec: WorkerSpec):
        logging.basicConfig(
            level=spec.log_level, format=f"%(asctime)s %(levelname)s {spec.worker_id} %(name)s: %(message)s"
        )
        self.server = WorkerServer(spec)

    def start(self, instance: Optional[InstanceRank] = None) -> WorkerInfo:
        """`instance`: this worker's rank of an expert-parallel instance (known once rank 0 is placed)."""
        if instance is not None:
            self.server.spec = dataclasses.replace(self.server.spec, instance=instance)
        info = self.server.start()
        freeze_startup_heap()  # the actor's process is this worker's alone: its model and engine stay
        return info

    def drain(self) -> int:
        return self.server.drain()

    def stats(self) -> WorkerLoad:
        return self.server.stats()

    def stop(self) -> None:
        self.server.stop()

    def watch(self) -> None:
        """Returns when the worker has stopped: the controller's call that fails the moment this
        actor's process dies (it holds one of the actor's threads for as long as the worker runs)."""
        self.server.stopped.wait()
