"""The head process of `deepinfer serve`: Ray, the router, the controller and the gateway.

One asyncio loop (uvloop) runs the router's gRPC server, the gateway's gRPC server
(Gateway + Cluster services, with reflection) and its HTTP server (uvicorn); the workers are
Ray actors, each with its own gRPC server, that register with the router.

`start_front()` starts only the front door (router + gateway), without Ray or workers: workers
started elsewhere register with `router_address`. `start()` is that plus Ray and the pools.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from services.common.grpc_util import bind, enable_reflection, new_server
from services.common.workers import POOL_NAMES
from services.controller.serve_config import HeadConfig

logger = logging.getLogger(__name__)


class Head:
    def __init__(self, config: HeadConfig):
        self.config = config
        self.stopped = asyncio.Event()
        self.router_address = ""
        """host:port of the router's gRPC server, where workers register."""
        self.http_url = ""
        self.grpc_address = ""
        self.router = None
        self.router_server = None
        self.router_client = None
        self.gateway = None
        self.grpc_server = None
        self.http_server = None
        self.http_task = None
        self.cluster_service = None
        self.controller = None
        self._ray_started = False
        self._loads: list = []

    async def start(self) -> None:
        """Ray, the front door, then the pools; returns once every worker is ready."""
        self._init_ray()
        await self.start_front()
        await self._start_pools()

    async def start_front(self) -> None:
        """The router and the gateway (HTTP + gRPC), serving; no Ray, no workers yet."""
        await self._start_router()
        self._start_gateway()
        await self.grpc_server.start()
        await self._start_http()

    async def _start_pools(self) -> None:
        from services.controller.controller import ClusterController

        cfg = self.config
        self.controller = ClusterController(cfg.pool_spec(), self.router, self.router_address)
        self.cluster_service.controller = self.controller
        print(f"deepinfer: starting workers {_describe(cfg.targets)} for model {cfg.model_name} ...", flush=True)
        await self.controller.scale(cfg.targets)
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
        self._ray_started = True
        print(f"deepinfer: Ray cluster at {context.address_info['gcs_address']}", flush=True)

    async def _start_router(self) -> None:
        from proto import router_pb2_grpc
        from services.router.clients import GrpcWorkerClient
        from services.router.core import RouterCore
        from services.router.registry import PoolRegistry
        from services.router.service import RouterService

        cfg = self.config
        self.router = RouterCore(PoolRegistry(GrpcWorkerClient), cfg.router_config(), cfg.model_name)
        self.router.start()
        self.router_server = new_server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(self.router), self.router_server)
        enable_reflection(self.router_server, ["deepinfer.v1.Router"])
        port = bind(self.router_server, "127.0.0.1", 0)
        self.router_address = f"127.0.0.1:{port}"
        await self.router_server.start()

    def _start_gateway(self) -> None:
        """The gateway core and its gRPC server (Gateway + Cluster services), bound, not yet started."""
        from deepinfer_core.tokenizer import load_tokenizer
        from proto import gateway_pb2_grpc
        from services.controller.service import ClusterService
        from services.gateway.core import GatewayCore
        from services.gateway.grpc_service import GatewayService, authorization
        from services.gateway.router_client import GrpcRouterClient

        cfg = self.config
        tokenizer = load_tokenizer(cfg.engine_args.tokenizer or cfg.model_path)
        self.router_client = GrpcRouterClient(self.router_address)
        self.gateway = GatewayCore(cfg.gateway_config(), tokenizer, self.router_client)
        self.grpc_server = new_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(self.gateway), self.grpc_server)

        def check(context):
            self.gateway.check_api_key(authorization(context))

        self.cluster_service = ClusterService(self.router, check)
        gateway_pb2_grpc.add_ClusterServicer_to_server(self.cluster_service, self.grpc_server)
        enable_reflection(self.grpc_server, ["deepinfer.v1.Gateway", "deepinfer.v1.Cluster"])
        self.grpc_address = f"{cfg.host}:{bind(self.grpc_server, cfg.host, cfg.grpc_port)}"

    async def _start_http(self) -> None:
        import uvicorn

        from services.gateway.http_app import build_app
        from services.metrics.load_collector import add_load_source

        cfg = self.config
        app = build_app(self.gateway, on_metrics=self._refresh_loads)
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.port))
        self.http_url = f"http://{cfg.host}:{sock.getsockname()[1]}"
        server_config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.http_server = uvicorn.Server(server_config)
        self.http_task = asyncio.ensure_future(self.http_server.serve(sockets=[sock]))
        add_load_source(lambda: self._loads)

    async def _refresh_loads(self) -> None:
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
        print("deepinfer: shutting down", flush=True)
        if self.http_server is not None:
            self.http_server.should_exit = True
            await asyncio.wait({self.http_task}, timeout=5)
        if self.grpc_server is not None:
            await self.grpc_server.stop(1)
        if self.controller is not None:
            await self.controller.shutdown()
        if self.router is not None:
            await self.router.stop()
        if self.router_server is not None:
            await self.router_server.stop(1)
        if self._ray_started:
            import ray

            ray.shutdown()


def _describe(targets: dict[int, int]) -> str:
    return ", ".join(f"{n} {POOL_NAMES[p]}" for p, n in targets.items())
