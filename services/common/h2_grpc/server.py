"""`H2GrpcServer`: a gRPC server for asyncio on an HTTP/2 implementation of its own (`connection.py`).

Why: through `grpc.aio`, each message of a server stream costs its handler ~40-65 µs of CPU (a
batch operation, a completion-queue event, its thread's hand-off to the event loop), whatever the
message's size. A front door that streams one message per generated token spends most of its CPU
there. Here a message is a DATA frame appended to its connection's buffer, and a fast lane can
hand one over already serialized (`benchmarks/grpc_server_floor.py`: 14.4 µs a message with a
handler task woken for each, against 65.4 through `grpc.aio`, on the 2-core machine).

It serves what the services register on a `grpc.aio.Server` the same way (the generated
`add_*Servicer_to_server` and `grpc.method_handlers_generic_handler`), with the four kinds of
method, status codes and details, initial and trailing metadata, `grpc-timeout`, cancellation by
the client, compressed requests (gzip, deflate), a receive-size limit, TLS (ALPN h2), and a stop
that lets calls in flight finish, keepalive PINGs that find clients gone, and `grpc.aio` server
interceptors (the cluster token's check on a worker's server).
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Sequence
from typing import Optional

import grpc

from services.common.h2_grpc.connection import GrpcConnection
from services.common.sockets import listen_socket


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata):
        self.method = method
        self.invocation_metadata = invocation_metadata


class H2GrpcServer:
    def __init__(
        self,
        max_receive_bytes: int = 4 * 1024 * 1024,
        keepalive_s: float = 20.0,
        keepalive_timeout_s: float = 10.0,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ):
        """`keepalive_s`: a PING to each client this often (0: none), which must be answered within
        `keepalive_timeout_s` (the gateway's `grpc.aio` server pinged the same way). `interceptors`:
        `grpc.aio` server interceptors, run once a call, in order, before its method is found."""
        self.max_receive_bytes = max_receive_bytes
        self.interceptors = tuple(interceptors)
        self.keepalive_s = keepalive_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections: set[GrpcConnection] = set()
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list = []
        self._sockets: list[tuple[socket.socket, object]] = []
        self._servers: list[asyncio.AbstractServer] = []

    # ---- what grpc's generated code and reflection call -----------------------------------------
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        for name, handler in handlers.items():
            self._registered[f"/{service}/{name}"] = handler

    def lookup(self, method: str, metadata) -> Optional[grpc.RpcMethodHandler]:
        handler = self._registered.get(method)
        if handler is not None:
            return handler
        details = _CallDetails(method, metadata)
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def resolve(self, method: str, metadata) -> Optional[grpc.RpcMethodHandler]:
        """The handler the interceptors let through for a call (each may replace it)."""

        async def found(details):
            return self.lookup(details.method, details.invocation_metadata)

        chain = found
        for interceptor in reversed(self.interceptors):
            chain = functools.partial(interceptor.intercept_service, chain)
        return await chain(_CallDetails(method, metadata))

    # ---- ports ----------------------------------------------------------------------------------------
    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, ssl_context) -> int:
        """`ssl_context`: an `ssl.SSLContext` for the server side (ALPN is set to h2 here)."""
        ssl_context.set_alpn_protocols(["h2"])
        return self._bind(address, ssl_context)

    def _bind(self, address: str, ssl_context) -> int:
        """Bind (SO_REUSEPORT, as grpc does on Linux: several API processes share a port); 0 on failure."""
        host, _, port = address.rpartition(":")
        try:
            sock = listen_socket(host.strip("[]") or "0.0.0.0", int(port), reuse_port=hasattr(socket, "SO_REUSEPORT"))
        except OSError:
            return 0
        self._sockets.append((sock, ssl_context))
        return sock.getsockname()[1]

    # ---- life --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock, ssl_context in self._sockets:
            sock.listen(1024)
            server = await loop.create_server(lambda: GrpcConnection(self), sock=sock, ssl=ssl_context)
            self._servers.append(server)

    async def stop(self, grace: Optional[float]) -> None:
        """Take no new connections nor calls; give the calls in flight `grace` seconds, then end them."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.go_away()
        if grace:
            tasks = [c.task for conn in self.connections for c in conn.calls.values() if c.task is not None]
            tasks = [t for t in tasks if not t.done()]
            if tasks:
                await asyncio.wait(tasks, timeout=grace)
            await asyncio.sleep(0)  # the last statuses leave
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
