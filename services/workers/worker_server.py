"""One worker process: build the engine, serve it over gRPC, register with the router.

An asyncio loop (uvloop) on a thread of its own runs the gRPC server and the core; the
engine runs on the host's thread. The Ray actor (`actor.py`) wraps this; tests may use it
directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from deepinfer_core.engine_type import EngineType
from services.common.grpc_util import bind, channel, enable_reflection, new_event_loop, new_server
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_NAMES, POOL_PREFILL, WorkerInfo, WorkerLoad

logger = logging.getLogger(__name__)

ENGINE_TYPE_OF_POOL = {
    POOL_PREFILL: EngineType.PROMPT,
    POOL_DECODE: EngineType.COMPLETION,
    POOL_COLOCATED: EngineType.NORMAL,
}


@dataclass
class WorkerSpec:
    worker_id: str
    pool: int
    """POOL_PREFILL, POOL_DECODE or POOL_COLOCATED."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """`EngineArgs` fields (model, device, max_model_len, block_size, num_gpu_blocks, ...)."""
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port; 0 = any free port."""
    router_address: str = ""
    """Register here once serving ("" = don't)."""
    torch_threads: int = 0
    """torch intra-op threads for the engine; 0 = torch's default."""
    metrics: bool = True
    """Serve /metrics on a free port."""


def build_engine(spec: WorkerSpec):
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine_args import EngineArgs
    from deepinfer_core.pd.completion_engine import CompletionEngine
    from deepinfer_core.pd.prompt_engine import PromptEngine

    engine_type = ENGINE_TYPE_OF_POOL[spec.pool]
    args = dict(spec.engine_args)
    if engine_type == EngineType.COMPLETION:
        args["stop_preempted_request"] = True
    cls = {EngineType.PROMPT: PromptEngine, EngineType.COMPLETION: CompletionEngine}.get(engine_type, LLMEngine)
    return cls.from_engine_args(EngineArgs(engine_type=engine_type, **args))


def core_class(pool: int):
    from services.workers.colocated_core import ColocatedCore
    from services.workers.decode_core import DecodeCore
    from services.workers.prefill_core import PrefillCore

    return {POOL_PREFILL: PrefillCore, POOL_DECODE: DecodeCore, POOL_COLOCATED: ColocatedCore}[pool]


class WorkerServer:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.info: Optional[WorkerInfo] = None
        self.core = None
        self._server = None
        self._metrics_server = None
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"loop-{spec.worker_id}", daemon=True)

    def start(self, timeout_s: float = 600.0) -> WorkerInfo:
        """Build the engine, start serving, register; returns once the router has the worker."""
        if self.spec.torch_threads:
            import torch

            torch.set_num_threads(self.spec.torch_threads)
        engine = build_engine(self.spec)
        self._thread.start()
        self.info = self._run(self._serve(engine), timeout_s)
        if self.spec.router_address:
            self._run(self._register(), 60.0)
        return self.info

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _serve(self, engine) -> WorkerInfo:
        from services.workers.service import add_services

        spec = self.spec
        self.core = core_class(spec.pool)(engine, spec.worker_id)
        self.core.start()
        self._server = new_server()
        enable_reflection(self._server, add_services(self._server, self.core))
        port = bind(self._server, spec.host, spec.port)
        await self._server.start()
        agent = engine.agent
        config = engine.config
        return WorkerInfo(
            worker_id=spec.worker_id,
            pool=spec.pool,
            engine_type=engine.engine_type.value,
            address=f"{spec.host}:{port}",
            metrics_address=self._start_metrics() if spec.metrics else "",
            agent_name=agent.name if agent is not None else "",
            agent_metadata=agent.metadata if agent is not None else b"",
            model=spec.model_name,
            max_model_len=config.scheduler.max_model_len,
            block_size=config.cache.block_size,
            num_blocks=engine.scheduler.block_manager.num_blocks,
            max_num_seqs=config.scheduler.max_num_seqs,
            pid=os.getpid(),
            kv_region=agent.region if agent is not None else None,
        )

    def _start_metrics(self) -> str:
        from prometheus_client import start_http_server

        from services.metrics.load_collector import add_load_source

        role = POOL_NAMES[self.spec.pool]
        add_load_source(lambda: [(role, self.spec.worker_id, self.core.stats())])
        self._metrics_server, _ = start_http_server(0, addr=self.spec.host)
        return f"{self.spec.host}:{self._metrics_server.server_port}"

    async def _register(self) -> None:
        from proto import router_pb2_grpc
        from services.common.messages import info_to_proto

        async with channel(self.spec.router_address) as ch:
            await router_pb2_grpc.RouterStub(ch).Register(info_to_proto(self.info), timeout=60)

    # ---- control (any thread) ----------------------------------------------------------------
    def drain(self) -> int:
        return self.core.drain()

    def stats(self) -> WorkerLoad:
        return self.core.stats()

    def stop(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            self._run(self._server.stop(grace_s), grace_s + 5)
        if self.core is not None:
            self.core.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
