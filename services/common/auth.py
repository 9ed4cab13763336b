"""The cluster credential: one shared token that every internal gRPC call carries.

The router's server (workers register there; the other API processes read its registry) and each
worker's server (the router sends it work) answer only calls whose metadata holds the cluster
token: without it anyone who can reach an internal port — any pod of a Kubernetes cluster — could
generate tokens past the gateway's API key, or register, deregister and drain workers. The head
makes a token per cluster (`new_token`) unless one is given (`--cluster-token`, for workers started
outside it) and hands it to its workers in their spec.

The gateway's public ports do not take the cluster token: they check the API key
(`GatewayCore.check_api_key`), the admin service (`deepinfer.v1.Cluster`: `deepinfer status` /
`scale`) included.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence

import grpc

TOKEN_KEY = "x-deepinfer-cluster-token"
"""The metadata key of the cluster token (gRPC metadata keys are lower case)."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata an internal call sends (none without a token)."""
    return ((TOKEN_KEY, token),) if token else ()


def interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: the token check, or none for a server that has no token (one a test
    builds by itself; `deepinfer serve` always has one)."""
    return [ClusterTokenCheck(token)] if token else []


class ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """Refuse (UNAUTHENTICATED) every call that does not carry the cluster token. It runs once per
    call, before the method: nothing is added per streamed message."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if self._has_token(details.invocation_metadata):
            return handler
        return _refusal(handler)

    def _has_token(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_KEY:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._token)
        return False


_REFUSED = "this internal service needs the cluster token (x-deepinfer-cluster-token metadata)"


def _refusal(handler):
    """A handler of the same kind as `handler` (streamed requests, streamed replies or not) that refuses."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # an async generator, as a streaming method is

    streams = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[streams]
    return make(refuse_stream if streams[1] else refuse)


class AuthedStub:
    """A generated stub whose every call carries the cluster token, beside any metadata the caller
    passes. The call objects are the stub's own (no client interceptor: nothing per message)."""

    def __init__(self, stub, token: str):
        fixed = token_metadata(token)
        for name, method in vars(stub).items():
            setattr(self, name, _with_metadata(method, fixed))


def _with_metadata(method, fixed: Sequence[tuple[str, str]]):
    if not fixed:
        return method

    def call(request, *args, metadata=(), **kwargs):
        return method(request, *args, metadata=(*fixed, *(metadata or ())), **kwargs)

    return call


def with_token(method, token: str):
    """One multicallable (`channel.unary_stream(...)`), sending the cluster token with every call."""
    return _with_metadata(method, token_metadata(token))


def stub(stub_class, channel, token: str):
    """`stub_class(channel)`, sending the cluster token with every call."""
    return AuthedStub(stub_class(channel), token)
