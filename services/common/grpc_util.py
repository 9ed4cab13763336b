"""gRPC plumbing shared by the services: error statuses, servers, channels, the event loop."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from typing import Optional

import grpc

from services.common.errors import ErrorCode, ServiceError, code_from_grpc

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def install_uvloop() -> None:
    """Use uvloop for new event loops where it is installed."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


CALL_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError)
"""What a call on a channel may raise: a failed call, or a channel already closed (a worker that
left the registry while a request still held it)."""


def error_from_rpc(e: grpc.aio.AioRpcError | grpc.aio.UsageError, what: str) -> ServiceError:
    """A failed call to another service, as a ServiceError naming `what` was called."""
    if isinstance(e, grpc.aio.UsageError):
        return ServiceError(ErrorCode.UNAVAILABLE, f"{what} is unreachable: its connection is closed ({e})")
    code = e.code()
    detail = e.details() or code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        return ServiceError(ErrorCode.UNAVAILABLE, f"{what} is unreachable: {detail}")
    return ServiceError(code_from_grpc(code), f"{what}: {detail}")


def handles_errors(method):
    """Turn a ServiceError raised by a servicer method (unary or server-streaming) into a status."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except ServiceError as e:
                await context.abort(e.code.grpc_status, e.message)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except ServiceError as e:
            await context.abort(e.code.grpc_status, e.message)

    return unary


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=CHANNEL_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port (0 = any free port); returns the port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def enable_reflection(server: grpc.aio.Server, service_full_names: list[str]) -> None:
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection([*service_full_names, reflection.SERVICE_NAME], server)


def channel(address: str, options: Optional[list] = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=options or CHANNEL_OPTIONS)
