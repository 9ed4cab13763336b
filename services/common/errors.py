"""One error type for every service core, with a code that maps to gRPC and to HTTP.

Cores raise `ServiceError(code, message)`; a gRPC `service.py` turns it into a status, the
HTTP gateway into an OpenAI-style error body. Code names are gRPC status names. What the engine
raises is mapped once, here (`engine_error`): the engine's error type says whose fault it is,
so no core guesses.
"""

from __future__ import annotations

import enum
from typing import Optional

import grpc

from deepinfer_core.errors import CapacityError, EngineError, InvalidRequestError, KVTargetRejected, TransferError


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the client's fault: never retried
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # no room now: another worker (or later) may have some
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # a stage refused a stale or foreign KV target
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return _GRPC_STATUS[self]


_HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.FAILED_PRECONDITION: 503,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}

_GRPC_STATUS = {code: grpc.StatusCode[code.value] for code in ErrorCode}
"""Every code is named after its gRPC status."""

_CODE_OF_GRPC = {status: code for code, status in _GRPC_STATUS.items()}

_ENGINE_ERRORS: list[tuple[type[EngineError], ErrorCode]] = [
    (InvalidRequestError, ErrorCode.INVALID_ARGUMENT),
    (KVTargetRejected, ErrorCode.FAILED_PRECONDITION),
    (CapacityError, ErrorCode.RESOURCE_EXHAUSTED),
    (TransferError, ErrorCode.INTERNAL),
]
"""The engine's error types and the code each one means to a caller."""


def code_from_grpc(status: grpc.StatusCode) -> ErrorCode:
    """The code for a gRPC status; statuses without a twin are INTERNAL."""
    return _CODE_OF_GRPC.get(status, ErrorCode.INTERNAL)


class ServiceError(Exception):
    """A request failed in a way the client should hear about: `code` says how."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        http_status: int | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        """The request field at fault, when one is (OpenAI's `param`)."""
        self.http_status = http_status or code.http_status
        """HTTP status for the gateway; a code may map to more than one (413 vs 400)."""
        self.retry_after_s = retry_after_s
        """Seconds after which a retry may find room (HTTP `Retry-After`, gRPC trailing metadata)."""

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


def engine_error(e: EngineError) -> ServiceError:
    """What an error the engine raised means to the caller of a worker."""
    for kind, code in _ENGINE_ERRORS:
        if isinstance(e, kind):
            return ServiceError(code, str(e))
    return ServiceError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")


_REFUSED_OUTPUTS = {
    "error": ErrorCode.INVALID_ARGUMENT,  # the scheduler could never schedule it (prompt over its limit)
    "preempted": ErrorCode.RESOURCE_EXHAUSTED,  # the KV cache filled up under it
    "abort": ErrorCode.CANCELLED,
}


def refused_output_error(finish_reason: str, error: Optional[str]) -> ServiceError:
    """A request the engine accepted and then ended before its first token."""
    code = _REFUSED_OUTPUTS.get(finish_reason, ErrorCode.INTERNAL)
    return ServiceError(code, error or f"the engine ended the request ({finish_reason}) before its first token")
