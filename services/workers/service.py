"""gRPC servicers of a worker: thin layers over its core (`decode_core.py`, `prefill_core.py`)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from deepinfer_proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import handles_errors, status_args
from services.common.messages import (
    batch_message,
    delta_to_proto,
    handle_from_proto,
    handle_to_proto,
    load_to_proto,
    prefill_result_to_proto,
    region_from_proto,
    target_from_proto,
    target_to_proto,
)
from services.common.params import params_from_proto
from services.workers.base_core import WorkerCore
from services.workers.decode_core import DecodeCore
from services.workers.encoder_core import EncoderCore
from services.workers.prefill_core import PrefillCore

logger = logging.getLogger(__name__)

_ADMITTED = worker_pb2.SubmitOutcome()
"""A batched Submit's outcome for an admitted work (status 0: OK)."""

_SUBSCRIPTION_IDLE_S = 10.0
"""An idle subscription sends an empty batch this often: a connection with no data on it for
minutes is closed by the peer's keepalive policy (too many pings without data)."""


def _params(request):
    try:
        return params_from_proto(request.params)
    except ValueError as e:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None


def _target(request):
    if not request.HasField("kv_target"):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "the request carries no kv_target", "kv_target")
    return target_from_proto(request.kv_target)


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore):
        self.core = core

    @handles_errors
    async def Prefill(self, request, context):
        images = list(request.images) + [handle_from_proto(h) for h in request.image_embeds]
        result = await self.core.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            _params(request),
            _target(request),
            images,
            resumed_tokens=request.resumed_tokens,
        )
        return prefill_result_to_proto(result)

    @handles_errors
    async def Abort(self, request, context):
        return worker_pb2.AbortReply(found=await self.core.abort(request.request_id))

    @handles_errors
    async def ConnectPeer(self, request, context):
        await self.core.connect_peer(request.agent_name, request.agent_metadata, region_from_proto(request, "region"))
        return worker_pb2.ConnectPeerReply()

    @handles_errors
    async def DisconnectPeer(self, request, context):
        await self.core.disconnect_peer(request.agent_name)
        return worker_pb2.DisconnectPeerReply()

    @handles_errors
    async def RenewLease(self, request, context):
        found = await self.core.renew_lease(request.request_id, request.expires_at)
        return worker_pb2.LeaseRenewalReply(found=found, expires_at=request.expires_at if found else 0.0)


class DecodeService(worker_pb2_grpc.DecodeServicer):
    """CE (Reserve / Stream / Abort) or NORMAL engine (Submit, Generate / Abort); either one's
    deltas through a subscriber's Subscribe call."""

    def __init__(self, core: DecodeCore):
        self.core = core

    @handles_errors
    async def Subscribe(self, request, context):
        outbox = self.core.open_subscription(request.subscriber_id)
        try:
            await context.send_initial_metadata(())  # the subscriber may name itself in requests now
            async for items in outbox.batches(idle_s=_SUBSCRIPTION_IDLE_S):
                yield batch_message(items)
        finally:
            self.core.close_subscription(outbox)

    @handles_errors
    async def Reserve(self, request, context):
        lease_s = request.lease_s or None  # 0: the engine's own lease
        target = await self.core.reserve(
            request.request_id, list(request.prompt_token_ids), _params(request), lease_s, request.subscriber_id
        )
        return worker_pb2.ReserveReply(kv_target=target_to_proto(target))

    @handles_errors
    async def Submit(self, request, context):
        await self._admit(request)
        return worker_pb2.SubmitReply()

    async def _admit(self, work) -> None:
        await self.core.submit(
            work.request_id,
            list(work.prompt_token_ids),
            _params(work),
            work.subscriber_id,
            list(work.images),
            resumed_tokens=work.resumed_tokens,
        )

    @handles_errors
    async def SubmitBatch(self, request, context):
        works = request.works
        if len(works) == 1:
            outcomes = [await self._submit_one(works[0])]
        else:  # concurrently: the engine thread takes every admission waiting for it in one turn
            outcomes = await asyncio.gather(*(self._submit_one(work) for work in works))
        return worker_pb2.SubmitBatchReply(outcomes=outcomes)

    async def _submit_one(self, work) -> worker_pb2.SubmitOutcome:
        """`Submit` for one work of a batch; its failure becomes its outcome, never the call's."""
        try:
            await self._admit(work)
        except ServiceError as e:
            status, message, retry_after_s = status_args(e)
            return worker_pb2.SubmitOutcome(status=status, message=message, retry_after_s=retry_after_s)
        except Exception as e:  # noqa: BLE001 - as a failed unary call would: UNKNOWN, its message
            logger.exception("Submit of %s failed", work.request_id)
            return worker_pb2.SubmitOutcome(status=grpc.StatusCode.UNKNOWN.value[0], message=f"{type(e).__name__}: {e}")
        return _ADMITTED

    @handles_errors
    async def Stream(self, request, context):
        async for delta in self.core.stream(request.request_id):
            yield delta_to_proto(delta)

    @handles_errors
    async def Generate(self, request, context):
        ids, images = list(request.prompt_token_ids), list(request.images)
        generated = self.core.generate(
            request.request_id, ids, _params(request), images, resumed_tokens=request.resumed_tokens
        )
        async for delta in generated:
            yield delta_to_proto(delta)

    @handles_errors
    async def Abort(self, request, context):
        return worker_pb2.AbortReply(found=await self.core.abort(request.request_id, request.unused))

    @handles_errors
    async def RenewLease(self, request, context):
        return await renew_lease(self.core, request)


class EncoderService(worker_pb2_grpc.EncoderServicer):
    def __init__(self, core: EncoderCore):
        self.core = core

    @handles_errors
    async def Encode(self, request, context):
        if request.lease_s < 0:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "lease_s must be >= 0", "lease_s")
        handles = await self.core.encode(request.request_id, list(request.images), request.lease_s)
        return worker_pb2.EncodeReply(handles=[handle_to_proto(h) for h in handles])

    @handles_errors
    async def Release(self, request, context):
        return worker_pb2.ReleaseReply(released=self.core.release(list(request.lease_ids)))

    @handles_errors
    async def RenewLease(self, request, context):
        return await renew_lease(self.core, request)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore):
        self.core = core

    async def Stats(self, request, context) -> common_pb2.WorkerLoad:
        return load_to_proto(self.core.stats())

    async def Health(self, request, context):
        ok, detail = self.core.health()
        return worker_pb2.HealthReply(ok=ok, detail=detail)

    async def Drain(self, request, context):
        return worker_pb2.DrainReply(requests=self.core.drain())


async def renew_lease(core, request) -> worker_pb2.LeaseRenewalReply:
    """`RenewLease` on a decode engine (a reservation) or a vision encoder (a request's embeddings)."""
    if request.lease_s <= 0:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "lease_s must be > 0", "lease_s")
    expires_at = await core.renew_lease(request.request_id, request.lease_s)
    return worker_pb2.LeaseRenewalReply(found=expires_at > 0, expires_at=expires_at)
