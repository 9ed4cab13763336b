"""The gateway's real front door (HTTP and gRPC servers on 127.0.0.1, free ports) over a router whose
only worker is a `ScriptedWorker`, on an event loop of its own thread: the gateway's own behaviour
(validation, admission, limits, its event loop) tested through real sockets, without Ray or engines."""

from __future__ import annotations

import asyncio
import threading

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from deepinfer_proto import gateway_pb2_grpc, router_pb2_grpc
from services.common.grpc_util import bind, new_server
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.front import GatewayFront
from services.gateway.router_client import GrpcRouterClient, LocalRouterClient
from services.router.config import RouterConfig
from services.router.service import RouterService
from tests.helpers.scripted_worker import ScriptedWorker, scripted_router


class ServedFront:
    def __init__(
        self,
        config: GatewayConfig,
        worker: ScriptedWorker | None = None,
        router_config: RouterConfig | None = None,
        router_over_grpc: bool = False,
    ):
        """`router_over_grpc`: the gateway reaches the router through its gRPC server, as in the cluster."""
        self.config = config
        self.worker = worker or ScriptedWorker()
        self.router_config = router_config
        self.router_over_grpc = router_over_grpc
        self.router = None
        self._router_server = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.front = self.call(self._start(), timeout_s=60)
        self.url = f"http://127.0.0.1:{self.front.http_port}"
        self.grpc_address = f"127.0.0.1:{self.front.grpc_port}"

    @property
    def core(self) -> GatewayCore:
        return self.front.core

    def call(self, coro, timeout_s: float = 30.0):
        """Run `coro` on the front's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> GatewayFront:
        router = self.router = await scripted_router(self.worker, self.router_config)
        client = LocalRouterClient(router)
        if self.router_over_grpc:
            self._router_server = new_server()
            router_pb2_grpc.add_RouterServicer_to_server(RouterService(router), self._router_server)
            port = bind(self._router_server, "127.0.0.1", 0)
            await self._router_server.start()
            client = GrpcRouterClient(f"127.0.0.1:{port}")
        core = GatewayCore(self.config, load_tokenizer(TINY_MODEL_DIR), client)
        front = GatewayFront(core, gateway_pb2_grpc.ClusterServicer())
        front.bind("127.0.0.1", 0, 0)
        await front.start()
        return front

    def stop(self) -> None:
        self.call(self.front.stop(), timeout_s=30)
        if self._router_server is not None:
            self.call(self._router_server.stop(1), timeout_s=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
