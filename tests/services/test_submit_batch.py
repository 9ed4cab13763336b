"""Submits coalesced per turn of the router's loop (`services/router/submit_batch.py`), over real
gRPC on 127.0.0.1: a burst of requests goes to a worker in fewer calls than requests, every
request gets what its own `Submit` would have answered (admitted, or refused with the same code
and message while the rest of its batch is admitted), a worker without `SubmitBatch` gets one
`Submit` per work, and a failed or malformed batch call fails each of its works clearly.

The real worker is a NORMAL engine on the embedded model in a worker server of this process; the
other cases use small servicers on a real gRPC server that answer as a broken or older worker would."""

import asyncio

import grpc
import pytest

from deepinfer_core import SamplingParams
from deepinfer_proto import worker_pb2, worker_pb2_grpc
from services.common import auth
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import channel, error_from_rpc, method_path
from services.common.h2_grpc.client import H2Channel
from services.common.params import params_to_proto
from services.common.workers import POOL_COLOCATED
from services.router.clients import GrpcWorkerClient
from services.router.submit_batch import SubmitBatcher
from services.workers.spec import EngineSettings, WorkerSpec
from services.workers.worker_server import WorkerServer

ARGS = EngineSettings(device="cpu", num_gpu_blocks=96, max_model_len=64, block_size=8)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def worker():
    server = WorkerServer(WorkerSpec("normal-0", POOL_COLOCATED, ARGS, metrics=False))
    server.start()
    yield server
    server.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _tokens(client: GrpcWorkerClient, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    out = []
    async for d in client.generate(request_id, prompt, params, timeout=WAIT_S):
        if d.error:
            raise AssertionError(d.error)
        out += d.token_ids
    return out


def test_a_burst_goes_in_fewer_calls_and_every_request_completes(worker):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]

    async def run():
        client = GrpcWorkerClient(worker.info)
        try:
            alone = [await _tokens(client, f"alone-{i}", p, _greedy(6)) for i, p in enumerate(prompts)]
            calls, works = client._submits.calls, client._submits.works
            together = await asyncio.gather(
                *(_tokens(client, f"burst-{i}", p, _greedy(6)) for i, p in enumerate(prompts))
            )
            return alone, together, (calls, works), (client._submits.calls - calls, client._submits.works - works)
        finally:
            await client.close()

    alone, together, sequential, burst = _run(run())
    assert together == alone and all(len(t) == 6 for t in alone)
    assert sequential == (8, 8)  # one at a time: nothing to coalesce
    assert burst[1] == 8 and burst[0] < 8, f"the burst of 8 took {burst[0]} calls"


def test_a_refused_work_fails_alone_with_what_its_own_submit_says(worker):
    too_long = list(range(1, 100))  # over max_model_len 64: the engine refuses it

    async def run():
        client = GrpcWorkerClient(worker.info)
        try:
            await client.generate("warm", [1, 2], _greedy(1), timeout=WAIT_S).__anext__()
            sub = client._subscription.subscriber_id
            stub = worker_pb2_grpc.DecodeStub(channel(worker.info.address))
            work = worker_pb2.GenerateWork(
                request_id="direct", prompt_token_ids=too_long, params=params_to_proto(_greedy(4)), subscriber_id=sub
            )
            try:
                await stub.Submit(work, timeout=WAIT_S)
                raise AssertionError("Submit admitted a prompt over max_model_len")
            except grpc.aio.AioRpcError as e:
                direct = error_from_rpc(e, client.name)
            good = [_tokens(client, f"good-{i}", [7, 8, i], _greedy(4)) for i in range(3)]
            results = await asyncio.gather(
                _tokens(client, "direct", too_long, _greedy(4)), *good, return_exceptions=True
            )
            return direct, results
        finally:
            await client.close()

    direct, results = _run(run())
    refused, *good = results
    assert isinstance(refused, ServiceError), refused
    assert (refused.code, refused.message) == (direct.code, direct.message)
    assert direct.code == ErrorCode.INVALID_ARGUMENT
    assert all(isinstance(g, list) and len(g) == 4 for g in good), good


class _Recorder(worker_pb2_grpc.DecodeServicer):
    """An older worker: Submit only (SubmitBatch is UNIMPLEMENTED, as the generated base answers)."""

    def __init__(self):
        self.submitted: list[str] = []

    async def Submit(self, request, context):
        self.submitted.append(request.request_id)
        if request.request_id.startswith("bad"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", (("retry-after", "3"),))
        return worker_pb2.SubmitReply()


class _Short(worker_pb2_grpc.DecodeServicer):
    """A broken worker: one outcome fewer than the works it was sent."""

    async def SubmitBatch(self, request, context):
        return worker_pb2.SubmitBatchReply(outcomes=[worker_pb2.SubmitOutcome()] * (len(request.works) - 1))


class _Slow(worker_pb2_grpc.DecodeServicer):
    async def SubmitBatch(self, request, context):
        await asyncio.sleep(0.3)
        return worker_pb2.SubmitBatchReply(outcomes=[worker_pb2.SubmitOutcome()] * len(request.works))


async def _serve(servicer):
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stub = auth.stub(worker_pb2_grpc.DecodeStub, channel(f"127.0.0.1:{port}"), "")
    # as the router makes them: SubmitBatch on the package's own client, Submit on grpc.aio
    submit_batch = H2Channel(f"127.0.0.1:{port}").unary_unary(
        method_path(worker_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["SubmitBatch"]),
        worker_pb2.SubmitBatchRequest.SerializeToString,
        worker_pb2.SubmitBatchReply.FromString,
    )
    return server, SubmitBatcher(submit_batch, stub.Submit, "worker w")


def _work(request_id: str) -> worker_pb2.GenerateWork:
    return worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=[1, 2], subscriber_id="s")


def test_a_worker_without_submit_batch_gets_one_submit_per_work():
    async def run():
        recorder = _Recorder()
        server, batcher = await _serve(recorder)
        try:
            ids = ["a", "bad-1", "b", "c"]
            first = await asyncio.gather(*(batcher.submit(_work(i), 5.0) for i in ids), return_exceptions=True)
            second = await asyncio.gather(batcher.submit(_work("d"), 5.0), batcher.submit(_work("e"), 5.0))
            return recorder.submitted, first, second
        finally:
            await server.stop(None)

    submitted, first, second = _run(run())
    assert sorted(submitted) == ["a", "b", "bad-1", "c", "d", "e"]
    assert first[0] is None and first[2] is None and first[3] is None and second == [None, None]
    refused = first[1]
    assert isinstance(refused, ServiceError) and refused.code == ErrorCode.RESOURCE_EXHAUSTED
    assert refused.message == "worker w: no room" and refused.retry_after_s == 3.0


def test_a_batch_answered_with_too_few_outcomes_fails_each_work():
    async def run():
        server, batcher = await _serve(_Short())
        try:
            return await asyncio.gather(
                *(batcher.submit(_work(f"r{i}"), 5.0) for i in range(3)), return_exceptions=True
            )
        finally:
            await server.stop(None)

    results = _run(run())
    assert all(isinstance(r, ServiceError) and r.code == ErrorCode.INTERNAL for r in results), results
    assert "2 outcomes for 3 works" in results[0].message


def test_a_worker_gone_fails_its_batch_as_unavailable():
    async def run():
        server, batcher = await _serve(_Slow())
        await server.stop(None)
        return await asyncio.gather(*(batcher.submit(_work(f"r{i}"), 2.0) for i in range(3)), return_exceptions=True)

    results = _run(run())
    assert all(isinstance(r, ServiceError) and r.code == ErrorCode.UNAVAILABLE for r in results), results
    assert all("worker w is unreachable" in r.message for r in results)


def test_a_caller_cancelled_while_its_batch_is_in_flight_leaves_the_others_answered():
    async def run():
        server, batcher = await _serve(_Slow())
        loop = asyncio.get_running_loop()
        unretrieved = []
        loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
        try:
            tasks = [asyncio.ensure_future(batcher.submit(_work(f"r{i}"), 5.0)) for i in range(3)]
            await asyncio.sleep(0.1)
            tasks[1].cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, batcher.calls, unretrieved
        finally:
            await server.stop(None)

    results, calls, unretrieved = _run(run())
    assert results[0] is None and results[2] is None and isinstance(results[1], asyncio.CancelledError)
    assert calls == 1 and not unretrieved
