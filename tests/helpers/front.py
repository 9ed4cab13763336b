"""The gateway's real front door (HTTP and gRPC servers on 127.0.0.1, free ports) over a router whose
only worker is a `ScriptedWorker`, on an event loop of its own thread: the gateway's own behaviour
(validation, admission, limits, its event loop) tested through real sockets, without Ray or engines."""

from __future__ import annotations

import asyncio
import threading

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from proto import gateway_pb2_grpc
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.front import GatewayFront
from services.gateway.router_client import LocalRouterClient
from tests.helpers.scripted_worker import ScriptedWorker, scripted_router


class ServedFront:
    def __init__(self, config: GatewayConfig, worker: ScriptedWorker | None = None):
        self.config = config
        self.worker = worker or ScriptedWorker()
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
        router = await scripted_router(self.worker)
        core = GatewayCore(self.config, load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(router))
        front = GatewayFront(core, gateway_pb2_grpc.ClusterServicer())
        front.bind("127.0.0.1", 0, 0)
        await front.start()
        return front

    def stop(self) -> None:
        self.call(self.front.stop(), timeout_s=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
