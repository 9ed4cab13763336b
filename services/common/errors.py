"""One error type for every service core, with a code that maps to gRPC and to HTTP.

Cores raise `ServiceError(code, message)`; a gRPC `service.py` turns it into a status, the
HTTP gateway into an OpenAI-style error body. Code names are gRPC status names.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # a stage refused a stale or foreign KV target
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


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


def code_from_grpc_name(name: str) -> ErrorCode:
    """The code for a gRPC status name; statuses without a twin are INTERNAL."""
    try:
        return ErrorCode(name)
    except ValueError:
        return ErrorCode.INTERNAL


class ServiceError(Exception):
    """A request failed in a way the client should hear about: `code` says how."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None, http_status: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        """The request field at fault, when one is (OpenAI's `param`)."""
        self.http_status = http_status or code.http_status
        """HTTP status for the gateway; a code may map to more than one (413 vs 400)."""

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"
