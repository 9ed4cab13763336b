"""The head process of `deepinfer serve`: Ray, the router, the controller and the gateway.

One asyncio loop (uvloop) runs the router's gRPC server, the gateway's gRPC server
(Gateway + Cluster services, with reflection) and its HTTP server (uvicorn); the workers are
Ray actors, each with its own gRPC server, that register with the router.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

from services.common.grpc_util import bind, enable_reflection, new_server
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL

logger = logging.getLogger(__name__)


@dataclass
class HeadConfig:
    model: Optional[str] = None
    """Hugging Face model directory; None = the embedded tiny model."""
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    """One NORMAL engine per replica (`decode` replicas) instead of P/D pools."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    api_key: Optional[str] = None
    max_n: int = 16
    max_concurrent_requests: int = 512
    request_timeout_s: float = 600.0
    torch_threads: int = 1
    gpus_per_worker: float = 0.0
    num_cpus: Optional[int] = None
    """CPUs Ray may schedule on this node (workers take none; set it to bound other Ray work)."""
    ray_address: Optional[str] = None
    """Join an existing Ray cluster instead of starting one."""
    log_level: str = "WARNING"

    @property
    def model_name(self) -> str:
        from deepinfer_core.builtin import TINY_MODEL_NAME

        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model)) if self.model else TINY_MODEL_NAME


class Head:
    def __init__(self, config: HeadConfig):
        self.config = config
        self.stopped = asyncio.Event()
        self.http_url = ""
        self.grpc_address = ""

    async def start(self) -> None:
        cfg = self.config
        self._init_ray()
        await self._start_router()
        await self._start_gateway()
        from services.controller.controller import ClusterController, PoolSpec

        spec = PoolSpec(
            cfg.engine_args, cfg.model_name, "127.0.0.1", cfg.torch_threads, cfg.gpus_per_worker, cfg.log_level
        )
        self.controller = ClusterController(spec, self.router, self.router_address)
        self._add_cluster_service()
        await self.grpc_server.start()
        targets = (
            {POOL_COLOCATED: cfg.decode} if cfg.colocated else {POOL_PREFILL: cfg.prefill, POOL_DECODE: cfg.decode}
        )
        print(f"deepinfer: starting workers {_describe(targets)} for model {cfg.model_name} ...", flush=True)
        await self.controller.scale(targets)
        print(
            f"deepinfer: ready — OpenAI API at {self.http_url}/v1 , gRPC at {self.grpc_address} "
            f"(model {cfg.model_name})",
            flush=True,
        )

    def _init_ray(self) -> None:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        verbose = self.config.log_level.upper() in ("DEBUG", "INFO")
        if self.config.ray_address:
            context = ray.init(address=self.config.ray_address, logging_level=logging.WARNING, log_to_driver=verbose)
        else:
            loopback = self.config.host in ("127.0.0.1", "localhost", "::1")
            context = ray.init(
                num_cpus=self.config.num_cpus or os.cpu_count() or 1,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=verbose,
                _node_ip_address="127.0.0.1" if loopback else None,
            )
        print(f"deepinfer: Ray cluster at {context.address_info['gcs_address']}", flush=True)

    async def _start_router(self) -> None:
        from proto import router_pb2_grpc
        from services.router.clients import GrpcWorkerClient
        from services.router.config import RouterConfig
        from services.router.core import RouterCore
        from services.router.registry import PoolRegistry
        from services.router.service import RouterService

        cfg = self.config
        pools = (POOL_COLOCATED,) if cfg.colocated else (POOL_PREFILL, POOL_DECODE)
        router_config = RouterConfig(request_timeout_s=cfg.request_timeout_s, max_n=cfg.max_n, pools=pools)
        self.router = RouterCore(PoolRegistry(GrpcWorkerClient), router_config, cfg.model_name)
        self.router.start()
        self.router_server = new_server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(self.router), self.router_server)
        enable_reflection(self.router_server, ["deepinfer.v1.Router"])
        port = bind(self.router_server, "127.0.0.1", 0)
        self.router_address = f"127.0.0.1:{port}"
        await self.router_server.start()

    async def _start_gateway(self) -> None:
        import uvicorn

        from deepinfer_core.builtin import TINY_MODEL_DIR
        from deepinfer_core.tokenizer import load_tokenizer
        from proto import gateway_pb2_grpc
        from services.gateway.core import GatewayConfig, GatewayCore
        from services.gateway.grpc_service import GatewayService
        from services.gateway.http_app import build_app
        from services.gateway.router_client import GrpcRouterClient

        cfg = self.config
        path = cfg.model or TINY_MODEL_DIR
        tokenizer = load_tokenizer(cfg.engine_args.get("tokenizer") or path)
        gw_config = GatewayConfig(
            model_name=cfg.model_name,
            max_model_len=_max_model_len(path, cfg.engine_args.get("max_model_len")),
            api_key=cfg.api_key,
            max_n=cfg.max_n,
            max_concurrent_requests=cfg.max_concurrent_requests,
            request_timeout_s=cfg.request_timeout_s,
        )
        self.router_client = GrpcRouterClient(self.router_address)
        self.gateway = GatewayCore(gw_config, tokenizer, self.router_client)
        self.grpc_server = new_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(self.gateway), self.grpc_server)
        self.grpc_address = f"{cfg.host}:{bind(self.grpc_server, cfg.host, cfg.grpc_port)}"
        app = build_app(self.gateway, on_metrics=self._refresh_loads)
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
        self.http_url = f"http://{cfg.host}:{sock.getsockname()[1]}"
        server_config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.http_server = uvicorn.Server(server_config)
        self.http_task = asyncio.ensure_future(self.http_server.serve(sockets=[sock]))
        self._loads: list = []
        from services.metrics.load_collector import add_load_source

        add_load_source(lambda: self._loads)

    def _add_cluster_service(self) -> None:
        from proto import gateway_pb2_grpc
        from services.controller.service import ClusterService
        from services.gateway.grpc_service import _authorization

        def check(context):
            self.gateway.check_api_key(_authorization(context))

        gateway_pb2_grpc.add_ClusterServicer_to_server(ClusterService(self.controller, check), self.grpc_server)
        enable_reflection(self.grpc_server, ["deepinfer.v1.Gateway", "deepinfer.v1.Cluster"])

    async def _refresh_loads(self) -> None:
        from services.common.workers import POOL_NAMES

        self._loads = [(POOL_NAMES[h.info.pool], h.worker_id, h.load) for h in self.router.registry.workers.values()]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopped.set)
        try:
            await self.start()
            done = asyncio.ensure_future(self.stopped.wait())
            await asyncio.wait({done, self.http_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self.stop()

    async def stop(self) -> None:
        import ray

        print("deepinfer: shutting down", flush=True)
        if hasattr(self, "http_server"):
            self.http_server.should_exit = True
            await asyncio.wait({self.http_task}, timeout=5)
        if hasattr(self, "grpc_server"):
            await self.grpc_server.stop(1)
        if hasattr(self, "controller"):
            await self.controller.shutdown()
        if hasattr(self, "router"):
            await self.router.stop()
            await self.router_server.stop(1)
        ray.shutdown()


def _max_model_len(path: str, override: Optional[int]) -> int:
    if override:
        return int(override)
    from deepinfer_core.models.hf_config import load_hf_config

    return int(load_hf_config(path).get("max_position_embeddings", 2048))


def _describe(targets: dict[int, int]) -> str:
    from services.common.workers import POOL_NAMES

    return ", ".join(f"{n} {POOL_NAMES[p]}" for p, n in targets.items())
