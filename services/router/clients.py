"""How the router talks to a worker: one interface, a gRPC implementation and an in-process one.

The router core only sees `WorkerClient`; `GrpcWorkerClient` is what runs in the cluster,
`LocalWorkerClient` calls a worker core directly (tests drive the router without gRPC).

A streaming worker's deltas come through one subscription per worker (`subscription.py`): one
message per engine turn for all of this router's requests there, each delta dispatched to its
request's inbox (`inbox.py`), which `stream` and `generate` read. A request's inbox is in place
before the request is sent, so no delta arrives unowned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Optional, Protocol, Union

import grpc

from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVRegion, KVTarget
from deepinfer_proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import auth
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import CALL_ERRORS, MAX_MESSAGE_BYTES, called, channel, error_from_rpc, method_path
from services.common.h2_grpc.client import H2Channel
from services.common.messages import (
    delta_from_proto,
    handle_from_proto,
    handle_to_proto,
    load_from_proto,
    prefill_result_from_proto,
    region_to_proto,
    target_from_proto,
    target_to_proto,
)
from services.common.params import params_to_proto
from services.common.prefill_result import PrefillResult
from services.common.workers import POOL_ENCODER, WorkerInfo, WorkerLoad
from services.router.inbox import RequestInbox
from services.router.submit_batch import SubmitBatcher
from services.router.subscription import DeltaSubscription, new_subscriber_id, subscribe_raw

logger = logging.getLogger(__name__)

_SUBMIT_BATCH = method_path(worker_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["SubmitBatch"])
_SUBSCRIBE_TIMEOUT_S = 10.0
"""The longest a request waits for its worker's subscription to open."""


class WorkerClient(Protocol):
    async def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float, timeout: float
    ) -> KVTarget: ...

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        kv_target: KVTarget,
        timeout: float,
        images: Sequence[Union[bytes, EmbeddingHandle]] = (),
        resumed_tokens: int = 0,
    ) -> PrefillResult:
        """`images`: one per image of the prompt: its encoded file, or where a vision encoder parked its embeddings.
        `resumed_tokens`: the prompt's last this many tokens are a migrated sample's output so far."""
        ...

    def stream(self, request_id: str, timeout: float) -> AsyncIterator[SampleDelta]:
        """A CE's deltas after the first token (which `prefill` returned)."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        timeout: float,
        images: Sequence[bytes] = (),
        resumed_tokens: int = 0,
    ) -> AsyncIterator[SampleDelta]: ...

    async def abort(self, request_id: str, prefill: bool, unused: bool = False) -> Optional[bool]:
        """End a sub-request; `unused`: a CE reservation whose target no PE was given (freed at once).
        Whether the worker held it; None when the worker could not be reached."""
        ...

    async def renew_lease(
        self, request_id: str, prefill: bool, lease_s: float, expires_at: float, timeout: float
    ) -> float:
        """A heartbeat for a lease held for a request that waits. CE (`prefill` False): extend its
        reservation to `lease_s` from now; VE (`prefill` False): the same for the leases on its
        images' embeddings; PE: its writes may be posted until `expires_at`. Returns the lease's end
        (wall clock; 0.0: the worker holds no such request). Raises ServiceError."""
        ...

    async def encode(
        self, request_id: str, images: Sequence[bytes], timeout: float, lease_s: float = 0.0
    ) -> list[EmbeddingHandle]:
        """A vision encoder: a lease on each image's embeddings, in order, for `lease_s` (0: the
        encoder's own), renewable under `request_id`."""
        ...

    async def release(self, lease_ids: list[int]) -> int:
        """A vision encoder: free leases no one will read."""
        ...

    async def connect_peer(self, agent_name: str, metadata: bytes, region: Optional[KVRegion] = None) -> None: ...

    async def disconnect_peer(self, agent_name: str) -> None: ...

    async def stats(self, timeout: float) -> WorkerLoad: ...

    async def drain(self, timeout: float) -> int: ...

    async def close(self) -> None: ...


class GrpcWorkerClient:
    """`batched`: take a streaming worker's deltas through a subscription (False, or a worker
    without `Subscribe`: each request's own `Stream` / `Generate` call)."""

    def __init__(self, info: WorkerInfo, batched: bool = True, cluster_token: str = ""):
        """`cluster_token`: sent with every call (the worker's server asks for it)."""
        self.name = f"{info.pool_name} worker {info.worker_id} ({info.address})"
        self.worker_id = info.worker_id
        self.pool = info.pool
        self.batched = batched
        self._channel = channel(info.address)
        self._prefill = auth.stub(worker_pb2_grpc.PrefillStub, self._channel, cluster_token)
        self._decode = auth.stub(worker_pb2_grpc.DecodeStub, self._channel, cluster_token)
        self._worker = auth.stub(worker_pb2_grpc.WorkerStub, self._channel, cluster_token)
        self._encoder = auth.stub(worker_pb2_grpc.EncoderStub, self._channel, cluster_token)
        self._fast = H2Channel(info.address, max_receive_bytes=MAX_MESSAGE_BYTES)
        """The calls made per request and per engine step (Subscribe, SubmitBatch), on the package's
        own HTTP/2 client: a fraction of `grpc.aio`'s CPU a call and a message."""
        self._subscribe_raw = auth.with_token(subscribe_raw(self._fast), cluster_token)
        submit_batch = self._fast.unary_unary(
            _SUBMIT_BATCH, worker_pb2.SubmitBatchRequest.SerializeToString, worker_pb2.SubmitBatchReply.FromString
        )
        self._submits = SubmitBatcher(auth.with_token(submit_batch, cluster_token), self._decode.Submit, self.name)
        """Submits of one turn of the loop go out as one call."""
        self._inboxes: dict[str, RequestInbox] = {}
        """request id -> inbox of every request of this worker that is read through the subscription."""
        self._subscription: Optional[DeltaSubscription] = None
        self._subscribing = asyncio.Lock()
        self._subscribe_attempts = 0
        self._subscribe_error: Optional[ServiceError] = None
        """Why the last attempt to subscribe failed: requests that waited for it fail the same way."""

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        inbox = await self._open_inbox(request_id, timeout)
        req = worker_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            lease_s=lease_s,
            subscriber_id=inbox.subscription.subscriber_id if inbox else "",
        )
        try:
            reply = await called(self._decode.Reserve, req, self.name, timeout=timeout)
        except BaseException:
            self._drop(request_id)
            raise
        return target_from_proto(reply.kv_target)

    async def prefill(
        self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0
    ) -> PrefillResult:
        req = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            kv_target=target_to_proto(kv_target),
            images=[i for i in images if isinstance(i, bytes)],
            image_embeds=[handle_to_proto(i) for i in images if isinstance(i, EmbeddingHandle)],
            resumed_tokens=resumed_tokens,
        )
        reply = await called(self._prefill.Prefill, req, self.name, timeout=timeout)
        return prefill_result_from_proto(reply)

    def stream(self, request_id, timeout) -> AsyncIterator[SampleDelta]:
        inbox = self._inboxes.get(request_id)
        if inbox is None:  # reserved without a subscription
            return self._read(
                lambda: self._decode.Stream(worker_pb2.StreamRequest(request_id=request_id), timeout=timeout)
            )
        return self._relay(request_id, inbox, asyncio.get_running_loop().time() + timeout)

    async def generate(
        self, request_id, prompt, params, timeout, images=(), resumed_tokens=0
    ) -> AsyncIterator[SampleDelta]:
        deadline = asyncio.get_running_loop().time() + timeout
        inbox = await self._open_inbox(request_id, timeout)
        req = worker_pb2.GenerateWork(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            images=list(images),
            resumed_tokens=resumed_tokens,
        )
        if inbox is None:
            async for msg in self._read(lambda: self._decode.Generate(req, timeout=timeout)):
                yield msg
            return
        req.subscriber_id = inbox.subscription.subscriber_id
        try:
            await self._submits.submit(req, max(0.0, deadline - asyncio.get_running_loop().time()))
        except BaseException:
            self._drop(request_id)
            raise
        # `_relay` inline: one generator fewer for each token to pass through
        inbox.expire_at(asyncio.get_running_loop(), deadline, self.name)
        try:
            async for delta in inbox.deltas():
                yield delta
        finally:
            self._drop(request_id, inbox)

    # ---- the subscription ----------------------------------------------------------------------
    def inbox(self, request_id: str) -> Optional[RequestInbox]:
        """The open inbox of a request read through the subscription (its fast lane attaches there)."""
        return self._inboxes.get(request_id)

    async def _open_inbox(self, request_id: str, timeout: float) -> Optional[RequestInbox]:
        """The request's inbox on this worker's subscription (opened if need be); None when the
        request is to be read through its own call."""
        if not self.batched:
            return None
        if request_id in self._inboxes:  # another request's: refused, its inbox left alone
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use on {self.name}"
            )
        subscription = self._subscription
        if subscription is None or subscription.broken:
            subscription = await self._subscribe(min(timeout, _SUBSCRIBE_TIMEOUT_S))
            if subscription is None:
                return None
        inbox = self._inboxes[request_id] = subscription.inbox()
        return inbox

    async def _subscribe(self, timeout: float) -> Optional[DeltaSubscription]:
        attempts = self._subscribe_attempts
        async with self._subscribing:  # concurrent first requests share one subscription
            subscription = self._subscription
            if not self.batched:
                return None
            if subscription is not None and not subscription.broken:  # another request opened it
                return subscription
            failed = self._subscribe_error
            if failed is not None and self._subscribe_attempts != attempts:  # it failed while we waited
                raise ServiceError(failed.code, failed.message)
            self._subscribe_attempts += 1
            try:
                subscription = await DeltaSubscription.open(
                    self._subscribe_raw, new_subscriber_id(self.worker_id), self.name, self._inboxes, timeout
                )
            except ServiceError as e:
                self._subscribe_error = e
                raise
            self._subscribe_error = None
            if subscription is None:
                logger.info("%s has no Subscribe: reading each request's own stream", self.name)
                self.batched = False
            self._subscription = subscription
            return subscription

    async def _relay(self, request_id: str, inbox: RequestInbox, deadline: float) -> AsyncIterator[SampleDelta]:
        inbox.expire_at(asyncio.get_running_loop(), deadline, self.name)
        try:
            async for delta in inbox.deltas():
                yield delta
        finally:
            self._drop(request_id, inbox)

    def _drop(self, request_id: str, inbox: Optional[RequestInbox] = None) -> None:
        """Let go of a request's inbox: later deltas for it are ignored."""
        if inbox is None or self._inboxes.get(request_id) is inbox:
            self._inboxes.pop(request_id, None)

    async def _read(self, make_call) -> AsyncIterator[SampleDelta]:
        """The deltas of the streaming call `make_call()` opens (inside the error mapping: a closed
        channel refuses to open one)."""
        call = None
        try:
            call = make_call()
            async for msg in call:
                yield delta_from_proto(msg)
        except CALL_ERRORS as e:
            raise error_from_rpc(e, self.name) from None
        finally:
            if call is not None:
                call.cancel()

    async def abort(self, request_id, prefill: bool, unused: bool = False) -> Optional[bool]:
        stub = self._prefill if prefill else self._decode
        if not prefill:
            self._drop(request_id)
        try:
            return (await stub.Abort(worker_pb2.AbortRequest(request_id=request_id, unused=unused), timeout=5)).found
        except CALL_ERRORS:
            return None  # unreachable: dead (it holds nothing) or cut off (it may still act)

    async def renew_lease(self, request_id, prefill: bool, lease_s: float, expires_at: float, timeout: float) -> float:
        stub = self._prefill if prefill else self._encoder if self.pool == POOL_ENCODER else self._decode
        req = worker_pb2.LeaseRenewal(request_id=request_id, lease_s=lease_s, expires_at=expires_at)
        return (await called(stub.RenewLease, req, self.name, timeout=timeout)).expires_at

    async def encode(self, request_id, images, timeout, lease_s: float = 0.0) -> list[EmbeddingHandle]:
        req = worker_pb2.EncodeRequest(request_id=request_id, images=list(images), lease_s=lease_s)
        try:
            reply = await self._encoder.Encode(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None
        return [handle_from_proto(h) for h in reply.handles]

    async def release(self, lease_ids) -> int:
        try:
            return (await self._encoder.Release(worker_pb2.ReleaseRequest(lease_ids=lease_ids), timeout=5)).released
        except grpc.aio.AioRpcError:
            return 0  # a dead encoder holds nothing

    async def connect_peer(self, agent_name, metadata, region=None) -> None:
        req = worker_pb2.ConnectPeerRequest(
            agent_name=agent_name, agent_metadata=metadata, region=region_to_proto(region)
        )
        await called(self._prefill.ConnectPeer, req, self.name, timeout=30)

    async def disconnect_peer(self, agent_name: str) -> None:
        request = worker_pb2.DisconnectPeerRequest(agent_name=agent_name)
        await called(self._prefill.DisconnectPeer, request, self.name, timeout=10)

    async def stats(self, timeout) -> WorkerLoad:
        return load_from_proto(await called(self._worker.Stats, common_pb2.StatusRequest(), self.name, timeout=timeout))

    async def drain(self, timeout) -> int:
        return (await called(self._worker.Drain, worker_pb2.DrainRequest(), self.name, timeout=timeout)).requests

    async def close(self) -> None:
        if self._subscription is not None:
            await self._subscription.close()
        await self._fast.close()
        await self._channel.close()


class LocalWorkerClient:
    """Calls a worker core in this process (same event loop)."""

    def __init__(self, core, name: Optional[str] = None):
        self.core = core
        self.name = name or f"worker {core.worker_id}"

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        return await self.core.reserve(request_id, prompt, params, lease_s)

    async def prefill(
        self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0
    ) -> PrefillResult:
        return await self.core.prefill(request_id, prompt, params, kv_target, images, resumed_tokens=resumed_tokens)

    def stream(self, request_id, timeout) -> AsyncIterator[SampleDelta]:
        return self.core.stream(request_id)

    def generate(self, request_id, prompt, params, timeout, images=(), resumed_tokens=0) -> AsyncIterator[SampleDelta]:
        return self.core.generate(request_id, prompt, params, images, resumed_tokens=resumed_tokens)

    async def abort(self, request_id, prefill: bool, unused: bool = False) -> Optional[bool]:
        return await (self.core.abort(request_id, unused) if unused else self.core.abort(request_id))

    async def renew_lease(self, request_id, prefill: bool, lease_s: float, expires_at: float, timeout: float) -> float:
        if prefill:
            return expires_at if await self.core.renew_lease(request_id, expires_at) else 0.0
        return await self.core.renew_lease(request_id, lease_s)

    async def encode(self, request_id, images, timeout, lease_s: float = 0.0) -> list[EmbeddingHandle]:
        return await self.core.encode(request_id, list(images), lease_s)

    async def release(self, lease_ids) -> int:
        return self.core.release(list(lease_ids))

    async def connect_peer(self, agent_name, metadata, region=None) -> None:
        await self.core.connect_peer(agent_name, metadata, region)

    async def disconnect_peer(self, agent_name: str) -> None:
        await self.core.disconnect_peer(agent_name)

    async def stats(self, timeout) -> WorkerLoad:
        return self.core.stats()

    async def drain(self, timeout) -> int:
        return self.core.drain()

    async def close(self) -> None:
        pass
