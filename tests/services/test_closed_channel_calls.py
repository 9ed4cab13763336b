"""A unary call cut off by its channel's close (a worker removed from the registry while the call
was in flight, or before it was made) ends as UNAVAILABLE, which the router retries, not as the
CancelledError (or UsageError) grpc.aio raises for it, which ended the request as an HTTP 500; a
task that is itself cancelled still is."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deepinfer_proto import worker_pb2, worker_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import called


class _SlowPrefill(worker_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        await asyncio.sleep(30)
        return worker_pb2.PrefillReply()


async def _with_server(body):
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillServicer_to_server(_SlowPrefill(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


async def _cut_by_close(address: str, wrap: bool):
    channel = grpc.aio.insecure_channel(address)
    stub = worker_pb2_grpc.PrefillStub(channel)
    request = worker_pb2.PrefillRequest(request_id="r")
    call = called(stub.Prefill, request, "prefill worker w", timeout=30) if wrap else stub.Prefill(request, timeout=30)
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.3)  # the call is in flight
    await channel.close()
    return await asyncio.gather(task, return_exceptions=True)


def test_grpc_aio_raises_cancelled_error_for_a_call_cut_by_its_channel_close():
    """What the wrapper exists for: the bare call ends in CancelledError though no task was cancelled."""
    (outcome,) = asyncio.run(_with_server(lambda a: _cut_by_close(a, wrap=False)))
    assert isinstance(outcome, asyncio.CancelledError)


def test_a_call_cut_by_its_channel_close_is_unavailable():
    (outcome,) = asyncio.run(_with_server(lambda a: _cut_by_close(a, wrap=True)))
    assert isinstance(outcome, ServiceError) and outcome.code == ErrorCode.UNAVAILABLE, outcome
    assert "prefill worker w" in outcome.message


def test_a_cancelled_task_is_still_cancelled():
    async def body(address: str):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.PrefillStub(channel)
            task = asyncio.ensure_future(called(stub.Prefill, worker_pb2.PrefillRequest(request_id="r"), "w"))
            await asyncio.sleep(0.3)
            task.cancel()  # the request itself is cancelled (its client left)
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(_with_server(body))


def test_a_call_on_a_channel_already_closed_is_unavailable():
    """A worker removed before the call was made: the closed channel refuses to open it."""

    async def body(address: str):
        channel = grpc.aio.insecure_channel(address)
        await channel.close()
        stub = worker_pb2_grpc.PrefillStub(channel)
        with pytest.raises(ServiceError) as refused:
            await called(stub.Prefill, worker_pb2.PrefillRequest(request_id="r"), "prefill worker w", timeout=5)
        assert refused.value.code == ErrorCode.UNAVAILABLE and "prefill worker w" in refused.value.message

    asyncio.run(_with_server(body))
