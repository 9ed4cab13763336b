"""The requests a router starts on one worker, admitted with one call per turn of its event loop.

A unary gRPC call costs the caller about 250 µs of CPU (measured on loopback, grpc.aio, several in
flight), which is more than the rest of a short request's work in the router; the worker's server
pays about as much again. Requests start in bursts (the clients of requests finished by one engine
step send their next ones together), so the `Submit`s a router makes while one turn of its loop
runs go out as one `SubmitBatch` when that turn ends: each work is admitted or refused on its own,
and its caller hears exactly what its own `Submit` would have said.

A worker that does not know `SubmitBatch` (UNIMPLEMENTED) is sent one `Submit` per work from then on.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import grpc

from deepinfer_proto import worker_pb2
from services.common.errors import ServiceError
from services.common.grpc_util import CALL_ERRORS, error_from_rpc, error_from_status, status_of_value


class SubmitBatcher:
    """One worker's coalesced admissions. `submit_batch` and `submit`: the worker's `SubmitBatch`
    and `Submit` calls (the cluster token's stubs); `name`: the worker, as errors name it."""

    def __init__(self, submit_batch, submit, name: str):
        self._submit_batch = submit_batch
        self._submit = submit
        self._name = name
        self._pending: list[tuple[worker_pb2.GenerateWork, asyncio.Future, float]] = []
        self._flush_scheduled = False
        self._batched = True
        """False once the worker answered UNIMPLEMENTED: every work then goes as its own Submit."""
        self._sends: set[asyncio.Task] = set()
        self.calls = 0
        """Calls made (batched or not), and the works they carried: the coalescing, for tests."""
        self.works = 0

    async def submit(self, work: worker_pb2.GenerateWork, timeout: float) -> None:
        """Admit `work` on the worker by `timeout` seconds from now; raises the ServiceError its
        `Submit` would have. Cancelled while waiting: the work may still have been admitted (as a
        cancelled `Submit` may have been); the caller aborts the request as it would then."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._pending.append((work, answer, loop.time() + timeout))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)  # after every task that runs on this turn of the loop
        await answer

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sends.add(task)  # held: a task only the loop refers to may be collected mid-call
        task.add_done_callback(self._sends.discard)

    async def _send(self, batch: list) -> None:
        self.calls += 1
        self.works += len(batch)
        if not self._batched:
            await self._singly(batch)
            return
        remaining = max(0.0, max(deadline for _, _, deadline in batch) - asyncio.get_running_loop().time())
        request = worker_pb2.SubmitBatchRequest(works=[work for work, _, _ in batch])
        try:
            reply = await self._submit_batch(request, timeout=remaining)
        except CALL_ERRORS as e:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._batched = False  # an older worker
                await self._singly(batch)
            else:
                _fail(batch, error_from_rpc(e, self._name))
            return
        except BaseException:  # cancelled (the router stops): so are its callers' waits
            for _, answer, _ in batch:
                answer.cancel()
            raise
        outcomes = reply.outcomes
        if len(outcomes) != len(batch):
            what = f"SubmitBatch answered {len(outcomes)} outcomes for {len(batch)} works"
            _fail(batch, error_from_status(grpc.StatusCode.INTERNAL, what, self._name))
            return
        for (_, answer, _), outcome in zip(batch, outcomes):
            _answer(answer, _error_of(outcome, self._name))

    async def _singly(self, batch: list) -> None:
        await asyncio.gather(*(self._one(work, answer, deadline) for work, answer, deadline in batch))

    async def _one(self, work, answer: asyncio.Future, deadline: float) -> None:
        try:
            await self._submit(work, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        except CALL_ERRORS as e:
            _answer(answer, error_from_rpc(e, self._name))
            return
        _answer(answer, None)


def _error_of(outcome: worker_pb2.SubmitOutcome, name: str) -> Optional[ServiceError]:
    if outcome.status == 0:
        return None
    retry_after_s = outcome.retry_after_s if outcome.retry_after_s > 0 else None
    return error_from_status(status_of_value(outcome.status), outcome.message, name, retry_after_s)


def _fail(batch: list, error: ServiceError) -> None:
    for _, answer, _ in batch:
        _answer(answer, error)


def _answer(answer: asyncio.Future, error: Optional[BaseException]) -> None:
    if answer.done():  # its caller was cancelled
        return
    if error is None:
        answer.set_result(None)
    else:
        answer.set_exception(error)
