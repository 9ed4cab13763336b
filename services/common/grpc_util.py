"""gRPC plumbing shared by the services: error statuses, servers, channels, the event loop."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from typing import Optional

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import ErrorCode, ServiceError, code_from_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest message an internal call sends or takes."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
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


async def called(method, request, what: str, **options):
    """The reply of the unary call `method(request, **options)` on a channel; its failure as a
    ServiceError naming `what`. The call is made in here: a closed channel refuses to open one
    (UsageError, at once) and that maps too.

    A call cut off by the close of its channel (the worker left the registry, e.g. declared dead,
    while the call was in flight) raises asyncio.CancelledError in grpc.aio although no task was
    cancelled. Left as it is, it ends the request as if the client had gone (an HTTP 500 from the
    server, not a retry): it is UNAVAILABLE. A CancelledError of a task that is itself being
    cancelled still propagates."""
    try:
        return await method(request, **options)
    except CALL_ERRORS as e:
        raise error_from_rpc(e, what) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise ServiceError(ErrorCode.UNAVAILABLE, f"{what} left while a call to it was in flight") from None


def error_from_rpc(e: grpc.aio.AioRpcError | grpc.aio.UsageError, what: str) -> ServiceError:
    """A failed call to another service, as a ServiceError naming `what` was called."""
    if isinstance(e, grpc.aio.UsageError):
        return ServiceError(ErrorCode.UNAVAILABLE, f"{what} is unreachable: its connection is closed ({e})")
    return error_from_status(e.code(), e.details(), what, retry_after_of(e))


def error_from_status(
    code: grpc.StatusCode, details: Optional[str], what: str, retry_after_s: Optional[float] = None
) -> ServiceError:
    """A call's failure status (or one work's in a batched call: `SubmitOutcome`) as a ServiceError."""
    detail = details or code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        return ServiceError(ErrorCode.UNAVAILABLE, f"{what} is unreachable: {detail}", retry_after_s=retry_after_s)
    return ServiceError(code_from_grpc(code), f"{what}: {detail}", retry_after_s=retry_after_s)


_STATUS_OF_VALUE = {status.value[0]: status for status in grpc.StatusCode}


def status_of_value(value: int) -> grpc.StatusCode:
    """The status whose number is `value` (as a batched call's outcomes carry it); UNKNOWN if none."""
    return _STATUS_OF_VALUE.get(value, grpc.StatusCode.UNKNOWN)


RETRY_AFTER_KEY = "retry-after"
"""Trailing metadata of a RESOURCE_EXHAUSTED status: whole seconds to wait, as HTTP's Retry-After."""
PUSHBACK_KEY = "grpc-retry-pushback-ms"
"""The same in milliseconds, under the name gRPC's own retry policy reads (gRFC A6)."""


class Malformed:
    """A request message that did not parse, handed to the servicer method in its place (`lenient`)."""

    def __init__(self, error: str):
        self.error = error


def _abort_args(e: ServiceError) -> tuple:
    metadata = ()
    if e.retry_after_s is not None:
        seconds = whole_seconds(e.retry_after_s)
        metadata = ((RETRY_AFTER_KEY, str(seconds)), (PUSHBACK_KEY, str(seconds * 1000)))
    return e.code.grpc_status, e.message, metadata


def status_args(e: ServiceError) -> tuple[int, str, float]:
    """What aborting with `e` would have told the caller, as one outcome of a batched call carries it:
    (status number, details, retry-after seconds as the status's metadata rounds them; 0: none)."""
    retry = float(whole_seconds(e.retry_after_s)) if e.retry_after_s is not None else 0.0
    return e.code.grpc_status.value[0], e.message, retry


def whole_seconds(retry_after_s: float) -> int:
    """A wait as `Retry-After` gives it: whole seconds, at least 1."""
    return max(1, round(retry_after_s))


def retry_after_of(e: grpc.aio.AioRpcError) -> Optional[float]:
    """The seconds a failed call's status says to wait (its `retry-after` trailing metadata), if any:
    a refusal passed on from another service keeps telling its client when to come back."""
    try:
        metadata = e.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a status without metadata
        return None
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _malformed(request) -> None:
    if isinstance(request, Malformed):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"the request message does not parse: {request.error}")


def handles_errors(method):
    """Turn a ServiceError raised by a servicer method (unary or server-streaming) into a status, and a
    request that did not parse (`Malformed`) into INVALID_ARGUMENT."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                _malformed(request)
                async for item in method(self, request, context):
                    yield item
            except ServiceError as e:
                await context.abort(*_abort_args(e))

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            _malformed(request)
            return await method(self, request, context)
        except ServiceError as e:
            await context.abort(*_abort_args(e))

    return unary


class _Captured:
    """Stands in for a server to catch the handlers that a generated `add_*Servicer_to_server` adds."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def _parse_or_malformed(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:  # a corrupt message, or a string field that is not UTF-8
            return Malformed(str(e))

    return deserialize


def add_lenient(add_servicer, servicer, server: grpc.aio.Server, raw_responses=frozenset()) -> None:
    """`add_servicer(servicer, server)` (a generated `add_*Servicer_to_server`), except that a request
    that does not parse reaches the method as `Malformed`: grpc would answer UNKNOWN for it, a status
    that blames nobody, where `handles_errors` answers INVALID_ARGUMENT, the client's fault. The
    methods named in `raw_responses` may also yield a response's wire bytes, sent as they are."""
    captured = _Captured()
    add_servicer(servicer, captured)
    handlers = {}
    for name, h in captured.handlers.items():
        h = h._replace(request_deserializer=_parse_or_malformed(h.request_deserializer))
        if name in raw_responses:
            h = h._replace(response_serializer=_bytes_or(h.response_serializer))
        handlers[name] = h
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(captured.service, handlers),))
    server.add_registered_method_handlers(captured.service, handlers)


def _bytes_or(serialize):
    def serializer(message) -> bytes:
        return message if message.__class__ is bytes else serialize(message)

    return serializer


GRPC_SERVERS = ("h2", "grpcio")
"""The gRPC servers a process can serve on: its own HTTP/2 (`services/common/h2_grpc`, a few µs of
CPU a message) or `grpc.aio` (~40-65 µs a message, ~400 µs a call)."""


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES, *, cluster_token: str = "", kind: str = "grpcio"):
    """A server refusing (RESOURCE_EXHAUSTED, before parsing) messages over `max_receive_bytes`; with
    `cluster_token` it answers only calls that carry it (`services/common/auth.py`). `kind`: one of
    `GRPC_SERVERS`."""
    from services.common.auth import interceptors

    if kind == "h2":
        from services.common.h2_grpc import H2GrpcServer

        return H2GrpcServer(max_receive_bytes, interceptors=interceptors(cluster_token))
    if kind != "grpcio":
        raise ValueError(f"a gRPC server is one of {GRPC_SERVERS}, not {kind!r}")
    options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in CHANNEL_OPTIONS]
    return grpc.aio.server(options=options, interceptors=interceptors(cluster_token))


def bind(server: grpc.aio.Server, host: str, port: int, credentials=None) -> int:
    """Bind a port (0 = any free port), over TLS with `credentials`, else insecure; returns the port.
    `credentials`: `grpc.ServerCredentials`, or an `ssl.SSLContext` for an `H2GrpcServer`."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def enable_reflection(server: grpc.aio.Server, service_full_names: list[str]) -> None:
    from grpc_reflection.v1alpha import _async, reflection, reflection_pb2_grpc

    names = [*service_full_names, reflection.SERVICE_NAME]
    if isinstance(server, grpc.aio.Server):
        reflection.enable_server_reflection(names, server)
    else:  # an asyncio server of another kind (`H2GrpcServer`): the asyncio servicer all the same
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(_async.ReflectionServicer(names), server)


def method_path(method) -> str:
    """A method's path on the wire ("/package.Service/Method") from its descriptor."""
    return f"/{method.containing_service.full_name}/{method.name}"


def channel(address: str, options: Optional[list] = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=options or CHANNEL_OPTIONS)
