"""The one mapping of engine errors to codes, and of codes to gRPC and HTTP statuses."""

import grpc

from deepinfer_core.errors import CapacityError, EngineError, InvalidRequestError, KVTargetRejected, TransferError
from services.common.errors import ErrorCode, code_from_grpc, engine_error


def test_each_engine_error_says_whose_fault_it_is():
    cases = [
        (InvalidRequestError("bad prompt"), ErrorCode.INVALID_ARGUMENT, 400),
        (KVTargetRejected("stale lease"), ErrorCode.FAILED_PRECONDITION, 503),
        (CapacityError("full"), ErrorCode.RESOURCE_EXHAUSTED, 429),
        (TransferError("peer gone"), ErrorCode.INTERNAL, 500),
        (EngineError("something else"), ErrorCode.INTERNAL, 500),
    ]
    for error, code, http_status in cases:
        mapped = engine_error(error)
        assert (mapped.code, mapped.http_status) == (code, http_status), error
        assert str(error) in mapped.message


def test_codes_are_their_grpc_statuses_both_ways():
    for code in ErrorCode:
        assert code.grpc_status.name == code.value
        assert code_from_grpc(code.grpc_status) is code
    assert code_from_grpc(grpc.StatusCode.UNIMPLEMENTED) is ErrorCode.INTERNAL
