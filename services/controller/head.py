"""The head process of `deepinfer serve`: Ray, the router, the controller and the gateway.

One asyncio loop (uvloop) runs the router's gRPC server (where workers register; it serves the
Cluster service too, for the other API processes; it answers only calls that carry the cluster
token, `services/common/auth.py`), the gateway's gRPC server (Gateway + Cluster services, with
reflection; the API key) and its HTTP server (uvicorn); both public ports serve TLS when given a
certificate (`services/gateway/tls.py`). On one machine Ray and UCX listen on loopback only
(`services/controller/loopback.py`). The gateway calls the router in-process
(`LocalRouterClient`): a token is not serialized again between them. The workers are Ray actors,
each with its own gRPC server, that register with the router.

With `api_workers` > 1 the head also starts that many - 1 extra API processes on the same HTTP and
gRPC ports (`services/gateway/api_workers.py`), each with a gateway and a router of its own that
mirrors this one's registry; admission counts are shared and /metrics sums every process. That
needs prometheus-client's multiprocess mode, set up before it is imported
(`services.metrics.multiprocess.shared_metrics`, as `deepinfer serve` does).

`start_front()` starts only the front door (router + gateway), without Ray or workers: workers
started elsewhere register with `router_address`. `start()` is that plus Ray and the pools.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from typing import Any

from services.common.gc_tuning import freeze_startup_heap
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
        self.gateway = None
        """The head's `GatewayCore`."""
        self.front = None
        """The head's `GatewayFront`: its gateway's gRPC and HTTP servers."""
        self.cluster_service = None
        self.controller = None
        self.planner = None
        """Sizes the pools from the pools file and, with `autoscale`, from their load."""
        self.api_workers = None
        """The extra API processes (`ApiWorkers`), when `config.api_workers` > 1."""
        self._ray_started = False
        self._load_source = None

    async def start(self) -> None:
        """Ray, the front door, then the pools; returns once every worker is ready."""
        self._init_ray()
        await self._serve_front()
        print(f"deepinfer: router at {self.router_address} (internal: the cluster token only)", flush=True)
        if self.api_workers is not None:
            self.api_workers.spawn()  # they start while the pools do
        await self._start_pools()
        if self.api_workers is not None:
            await self.api_workers.wait_ready()
            await self.api_workers.wait_synced(lambda: list(self.router.registry.workers))
        freeze_startup_heap()
        print(
            f"deepinfer: ready — OpenAI API at {self.http_url}/v1 , gRPC at {self.grpc_address} "
            f"(model {self.config.model_name})",
            flush=True,
        )

    async def start_front(self) -> None:
        """The router and the gateway (HTTP + gRPC) of every API process, serving; no Ray, no workers yet."""
        await self._serve_front()
        if self.api_workers is not None:
            self.api_workers.spawn()
            await self.api_workers.wait_ready()
        freeze_startup_heap()

    async def _serve_front(self) -> None:
        await self._start_router()
        self._start_gateway()
        await self.front.start()

    async def _start_pools(self) -> None:
        from services.controller.controller import ClusterController

        cfg = self.config
        from services.controller.planner import start_planner

        self.controller = ClusterController(cfg.pool_spec(), self.router, self.router_address)
        # the pools file's placements reach the controller before its first engine starts
        self.planner = start_planner(self.controller, cfg.pools_config, cfg.autoscale)
        self.cluster_service.controller = self.controller
        print(f"deepinfer: starting workers {_describe(cfg.targets)} for model {cfg.model_name} ...", flush=True)
        await self.controller.scale(cfg.targets)

    def _init_ray(self) -> None:
        import ray

        from services.controller.loopback import prepare_ray
        from services.metrics import multiprocess

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        verbose = self.config.log_level.upper() in ("DEBUG", "INFO")
        node_ip = prepare_ray(self.config.ray_address, self.config.cluster_host)
        with multiprocess.hidden():  # the workers serve metrics of their own, never summed with ours
            if self.config.ray_address:
                context = ray.init(
                    address=self.config.ray_address,
                    logging_level=logging.WARNING,
                    log_to_driver=verbose,
                    **self._engine_runtime_env(),
                )
            else:
                context = ray.init(
                    address="local",  # a cluster of our own, even when another runs on this machine
                    num_cpus=self.config.num_cpus or os.cpu_count() or 1,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    log_to_driver=verbose,
                    _node_ip_address=node_ip,
                )
        self._ray_started = True
        print(f"deepinfer: Ray cluster at {context.address_info['gcs_address']}", flush=True)

    def _engine_runtime_env(self) -> dict[str, Any]:
        """A bucket KV store's AWS credentials for the engines of a cluster started elsewhere (its
        workers have their own environment; a cluster of our own inherits this one)."""
        if self.config.engine_args.kv_store.url is None:
            return {}
        from deepinfer_core.kvstore.bucket import engine_env

        env = engine_env(dict(os.environ))
        return {"runtime_env": {"env_vars": env}} if env else {}

    async def _start_router(self) -> None:
        from deepinfer_proto import gateway_pb2_grpc, router_pb2_grpc
        from services.controller.service import ClusterService
        from services.router.clients import GrpcWorkerClient
        from services.router.core import RouterCore
        from services.router.registry import PoolRegistry
        from services.router.service import RouterService

        cfg = self.config
        clients = functools.partial(GrpcWorkerClient, cluster_token=cfg.cluster_token)
        self.router = RouterCore(PoolRegistry(clients), cfg.router_config(), cfg.model_name)
        self.router.start()
        # workers register here and the other API processes read it: only with the cluster token
        self.router_server = new_server(cluster_token=cfg.cluster_token)
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(self.router), self.router_server)
        self.cluster_service = ClusterService(self.router, self._check_api_key)
        # the other API processes pass the Cluster calls that reach them on to here
        gateway_pb2_grpc.add_ClusterServicer_to_server(self.cluster_service, self.router_server)
        if cfg.internal_reflection:
            enable_reflection(self.router_server, ["deepinfer.v1.Router", "deepinfer.v1.Cluster"])
        host, advertised = _router_host(cfg.cluster_host)
        port = bind(self.router_server, host, 0)
        self.router_address = f"{advertised}:{port}"
        await self.router_server.start()

    def _check_api_key(self, context) -> None:
        from services.gateway.grpc_service import authorization

        self.gateway.check_api_key(authorization(context))

    def _start_gateway(self) -> None:
        """The head's gateway, calling the router in-process, and its servers, bound, not yet started."""
        from deepinfer_core.tokenizer import load_tokenizer
        from services.gateway.admission import Admission
        from services.gateway.core import GatewayCore
        from services.gateway.front import GatewayFront, check_port_free
        from services.gateway.router_client import LocalRouterClient
        from services.metrics import multiprocess
        from services.metrics.load_collector import add_load_source, registry_source

        cfg = self.config
        self._gateway_config = cfg.gateway_config()
        metrics_dir = multiprocess.directory()
        counts = None
        if cfg.api_workers > 1:
            if metrics_dir is None:
                raise RuntimeError("api_workers > 1 needs services.metrics.multiprocess.shared_metrics() set up first")
            from services.gateway.api_workers import ApiWorkers

            self.api_workers = ApiWorkers(cfg.api_workers, self._api_process_spec)
            counts = self.api_workers.counts
        admission = Admission(self._gateway_config.work_limits, counts)
        tokenizer = load_tokenizer(self._tokenizer_path())
        self.gateway = GatewayCore(self._gateway_config, tokenizer, LocalRouterClient(self.router), admission)
        registry = multiprocess.scrape_registry(metrics_dir) if metrics_dir else None
        self.front = GatewayFront(self.gateway, self.cluster_service, registry, tls=cfg.tls)
        self._load_source = registry_source(self.router.registry)
        add_load_source(self._load_source)
        for port in (cfg.port, cfg.grpc_port):  # a port shared by SO_REUSEPORT must be ours alone
            check_port_free(cfg.host, port)
        self.front.bind(cfg.host, cfg.port, cfg.grpc_port, reuse_port=cfg.api_workers > 1)
        self.http_url = f"{cfg.tls.http_scheme}://{cfg.host}:{self.front.http_port}"
        self.grpc_address = f"{cfg.host}:{self.front.grpc_port}"

    def _tokenizer_path(self) -> str:
        return self.config.engine_args.tokenizer or self.config.model_path

    def _api_process_spec(self, index: int):
        from services.gateway.api_process import ApiProcessSpec

        cfg = self.config
        return ApiProcessSpec(
            index=index,
            gateway=self._gateway_config,
            router=cfg.router_config(),
            model_name=cfg.model_name,
            tokenizer_path=self._tokenizer_path(),
            host=cfg.host,
            http_port=self.front.http_port,
            grpc_port=self.front.grpc_port,
            head_address=self.router_address,
            counts_path=self.api_workers.counts_path,
            cluster_token=cfg.cluster_token,
            tls=cfg.tls,
            log_level=cfg.log_level,
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopped.set)
        try:
            await self.start()
            done = asyncio.ensure_future(self.stopped.wait())
            await asyncio.wait({done, self.front.http_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """The other API processes first (they stream from the workers too), then this one's front
        door, the pools, the router and Ray."""
        from services.metrics.load_collector import remove_load_source

        print("deepinfer: shutting down", flush=True)
        if self.api_workers is not None:
            await self.api_workers.stop()
        if self.front is not None:
            await self.front.stop()
        if self.planner is not None:
            await self.planner.stop()
        if self.controller is not None:
            await self.controller.shutdown()
        if self.router is not None:
            await self.router.stop()
        if self.router_server is not None:
            await self.router_server.stop(1)
        remove_load_source(self._load_source)
        if self._ray_started:
            import ray

            ray.shutdown()


def _describe(targets: dict[int, int]) -> str:
    return ", ".join(f"{n} {POOL_NAMES[p]}" for p, n in targets.items())


def _router_host(cluster_host: str) -> tuple[str, str]:
    """(address the router binds, address workers reach it at). "auto": every interface, reached at
    this node's IP (workers on other machines); else that one address."""
    if cluster_host != "auto":
        return cluster_host, cluster_host
    import socket

    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # no Ray here (the front door alone)
        ip = socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", ip
