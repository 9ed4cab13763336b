"""One process's front door: the gateway's gRPC server (the Gateway and Cluster services, with
reflection) and its HTTP server (uvicorn), over one `GatewayCore`.

The gRPC server is `H2GrpcServer` (`services/common/h2_grpc`) unless the config asks for `grpc.aio`
(`grpc_server="grpcio"`): both serve the same services; the first costs a streamed message a few
µs of CPU where the second costs ~40-65.

The head runs one; so does each extra API process of `deepinfer serve --api-workers N`, on the same
two ports: the HTTP socket sets SO_REUSEPORT (`reuse_port`), and gRPC sets it on Linux by default, so
the kernel spreads new connections over the processes.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Optional

from services.common.grpc_util import add_lenient, bind, enable_reflection, new_server
from services.common.h2_grpc import H2GrpcServer
from services.common.sockets import listen_socket
from services.gateway.core import GatewayCore
from services.gateway.tls import TLSConfig

_STOP_GRACE_S = 5.0
PROCESS_HEADER = "x-deepinfer-process"
"""Names the API process that answered (0 = the head)."""


class GatewayFront:
    def __init__(
        self, core: GatewayCore, cluster_servicer, metrics_registry=None, process: int = 0, tls: TLSConfig = TLSConfig()
    ):
        """`cluster_servicer`: the `deepinfer.v1.Cluster` service of this process (the head's own,
        or a proxy to it); `metrics_registry`: what /metrics serves (None: this process's);
        `process`: this API process's index, in the `x-deepinfer-process` header of every response;
        `tls`: the certificate both ports serve with (none: plain HTTP, insecure gRPC)."""
        from deepinfer_proto import gateway_pb2_grpc
        from services.gateway.grpc_service import RAW_RESPONSES, GatewayService
        from services.gateway.http_app import build_app

        self.core = core
        # the same size limit as an HTTP body's: a larger message is refused before it is parsed
        self.grpc_server = new_server(core.config.max_request_bytes, kind=core.config.grpc_server)
        servicer = GatewayService(core)
        add_lenient(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, self.grpc_server, RAW_RESPONSES)
        gateway_pb2_grpc.add_ClusterServicer_to_server(cluster_servicer, self.grpc_server)
        enable_reflection(self.grpc_server, ["deepinfer.v1.Gateway", "deepinfer.v1.Cluster"])
        self.app = build_app(core, metrics_registry=metrics_registry)
        self.process = process
        self.tls = tls
        self.http_port = self.grpc_port = 0
        self.http_server = None
        self.http_task: Optional[asyncio.Future] = None
        self._sock: Optional[socket.socket] = None

    def bind(self, host: str, http_port: int, grpc_port: int, reuse_port: bool = False) -> None:
        """Bind both ports (0 = any free one); they serve once `start()` runs."""
        credentials = None
        if self.tls.enabled:
            h2 = isinstance(self.grpc_server, H2GrpcServer)
            credentials = self.tls.server_context() if h2 else self.tls.grpc_credentials()
        self.grpc_port = bind(self.grpc_server, host, grpc_port, credentials)
        self._sock = listen_socket(host, http_port, reuse_port)
        self.http_port = self._sock.getsockname()[1]

    async def start(self) -> None:
        import uvicorn

        await self.grpc_server.start()
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=30,
            headers=[(PROCESS_HEADER, str(self.process))],  # written once per response by uvicorn itself
            **self.tls.uvicorn_options(),
        )
        self.http_server = uvicorn.Server(config)
        self.http_task = asyncio.ensure_future(self.http_server.serve(sockets=[self._sock]))

    async def stop(self) -> None:
        """Stop taking connections, give the requests in flight a few seconds, then close."""
        if self.http_task is not None:
            self.http_server.should_exit = True
            await asyncio.wait({self.http_task}, timeout=_STOP_GRACE_S)
        await self.grpc_server.stop(1)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError when something listens on `host:port` already. A socket with SO_REUSEPORT
    (every gRPC server's, and ours with several API processes) would silently share the port with
    another server of the same user instead of failing."""
    if port:
        listen_socket(host, port, reuse_port=False).close()
