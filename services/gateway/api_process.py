"""An extra API process of `deepinfer serve --api-workers N` (processes 1..N-1; process 0 is the head).

It serves the head's HTTP and gRPC ports with a gateway and a `RouterCore` of its own, so no token
crosses an extra hop. Its registry mirrors the head's router (the router of record, where workers
register) by polling `Router.Status`; it polls each worker's load itself, as the head's router does.
The same reply lists the workers the head saw die (the controller watches its engines), so a
reservation this process fenced against a dead PE's writes is freed within a poll of the death.
Admission counts are shared by every process (`admission.py`) and metrics summed
(`services/metrics/multiprocess.py`).

What the head sees, over a pipe: ("ready", pid) once it serves — only after its first copy of the
registry, so it never takes a connection it cannot route — then ("workers", ids) after each change
of its registry. It exits with code 1 rather than serve half-dead: when its HTTP server ends, when
the head is gone (its parent changed, or the pipe broke) or when the head's router has not answered
for `_HEAD_LOST_S`; the head then starts it again. SIGTERM stops it (code 0); it ignores SIGINT,
which a terminal's Ctrl-C sends its whole process group: the head stops it then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from services.common.errors import ServiceError
from services.common.gc_tuning import freeze_startup_heap
from services.gateway.core import GatewayConfig
from services.gateway.tls import TLSConfig
from services.router.config import RouterConfig

logger = logging.getLogger(__name__)

_HEAD_LOST_S = 10.0
"""The head's router not answering this long means the head is gone."""


@dataclass(frozen=True)
class ApiProcessSpec:
    index: int
    """1..N-1 (0 is the head); the `process` label of its metrics and its slot in the admission counts."""
    gateway: GatewayConfig
    router: RouterConfig
    model_name: str
    tokenizer_path: str
    host: str
    http_port: int
    """The head's ports (already bound there), never 0."""
    grpc_port: int
    head_address: str
    """host:port of the head's router server (Router and Cluster services)."""
    counts_path: str
    """The shared admission counts (`SharedCounts`)."""
    cluster_token: str = field(default="", repr=False)
    """Sent with every call to the head's router and to the workers."""
    tls: TLSConfig = TLSConfig()
    """The public ports' certificate, as the head serves them."""
    log_level: str = "WARNING"


def main(spec: ApiProcessSpec, conn) -> None:
    """The spawned process: serve until stopped; the exit code says why it ended."""
    from services.common.grpc_util import install_uvloop

    fmt = f"%(asctime)s %(levelname)s api-{spec.index} %(name)s: %(message)s"
    logging.basicConfig(level=spec.log_level, format=fmt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install_uvloop()
    sys.exit(asyncio.run(_serve(spec, conn)))


async def _serve(spec: ApiProcessSpec, conn) -> int:
    return await ApiProcess(spec, conn).run()  # built on the loop: its gRPC channels need one


class ApiProcess:
    def __init__(self, spec: ApiProcessSpec, conn):
        from services.gateway.router_client import GrpcRouterClient
        from services.router.clients import GrpcWorkerClient
        from services.router.core import RouterCore
        from services.router.registry import PoolRegistry, RegistryMirror

        self.spec = spec
        self.conn = conn
        self.head_pid = os.getppid()
        clients = functools.partial(GrpcWorkerClient, cluster_token=spec.cluster_token)
        self.router = RouterCore(PoolRegistry(clients), spec.router, spec.model_name)
        self.mirror = RegistryMirror(self.router.registry)
        self.head = GrpcRouterClient(spec.head_address, spec.cluster_token)
        self.front = None
        self.proxy = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
        try:
            await self._first_copy()
            self.router.start()
            self.front = self._build_front()
            spec = self.spec
            self.front.bind(spec.host, spec.http_port, spec.grpc_port, reuse_port=True)
            await self.front.start()
            freeze_startup_heap()
            if not self._send("ready", os.getpid()):
                return 1
            return await self._serve(stopped)
        finally:
            await self._close()

    def _build_front(self):
        from deepinfer_core.tokenizer import load_tokenizer
        from services.gateway.admission import Admission, SharedCounts
        from services.gateway.cluster_proxy import ClusterProxy
        from services.gateway.core import GatewayCore
        from services.gateway.front import GatewayFront
        from services.gateway.router_client import LocalRouterClient
        from services.metrics import multiprocess
        from services.metrics.load_collector import add_load_source, registry_source

        spec = self.spec
        counts = SharedCounts(spec.counts_path, spec.index)
        admission = Admission(spec.gateway.work_limits, counts, spec.index)
        tokenizer = load_tokenizer(spec.tokenizer_path)
        core = GatewayCore(spec.gateway, tokenizer, LocalRouterClient(self.router), admission)
        path = multiprocess.directory()
        registry = multiprocess.scrape_registry(path) if path else None
        add_load_source(registry_source(self.router.registry))
        self.proxy = ClusterProxy(spec.head_address, spec.cluster_token)
        return GatewayFront(core, self.proxy, registry, spec.index, spec.tls)

    async def _serve(self, stopped: asyncio.Event) -> int:
        stop = asyncio.ensure_future(stopped.wait())
        follow = asyncio.ensure_future(self._follow())
        http = self.front.http_task
        done, _ = await asyncio.wait({stop, follow, http}, return_when=asyncio.FIRST_COMPLETED)
        try:
            if stop in done:
                return 0
            reason = follow.result() if follow in done else "its HTTP server ended"
            logger.error("API process %d stops: %s", self.spec.index, reason)
            return 1
        finally:
            stop.cancel()
            follow.cancel()

    # ---- the mirror ----------------------------------------------------------------------------
    async def _first_copy(self) -> None:
        give_up = time.monotonic() + _HEAD_LOST_S
        while True:
            try:
                return await self._copy()
            except ServiceError:
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.2)

    async def _copy(self) -> None:
        from services.common.messages import info_from_proto

        status = await self.head.status()
        listed = [(info_from_proto(w.info), w.state) for p in status.pools for w in p.workers]
        await self.mirror.apply(listed, [(d.worker_id, d.pid) for d in status.dead_workers])

    async def _follow(self) -> str:
        """Mirror the head's registry until the head is gone; returns why it stopped."""
        reported: Optional[list[str]] = None
        answered = time.monotonic()
        while True:
            if os.getppid() != self.head_pid:
                return "the head process is gone"
            try:
                await self._copy()
                answered = time.monotonic()
            except ServiceError as e:
                if time.monotonic() - answered > _HEAD_LOST_S:
                    return f"the head's router has not answered for {_HEAD_LOST_S:.0f} s: {e.message}"
            ids = sorted(self.router.registry.workers)
            if ids != reported:
                if not self._send("workers", ids):
                    return "the pipe to the head broke"
                reported = ids
            await asyncio.sleep(self.spec.router.poll_interval_s)

    def _send(self, kind: str, value) -> bool:
        try:
            self.conn.send((kind, value))
            return True
        except OSError:
            return False

    async def _close(self) -> None:
        if self.front is not None:
            await self.front.stop()
        if self.proxy is not None:
            await self.proxy.close()
        await self.router.stop()
        await self.head.close()
