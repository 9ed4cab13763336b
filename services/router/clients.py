"""How the router talks to a worker: one interface, a gRPC implementation and an in-process one.

The router core only sees `WorkerClient`; `GrpcWorkerClient` is what runs in the cluster,
`LocalWorkerClient` calls a worker core directly (tests drive the router without gRPC).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Optional, Protocol

import grpc

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVRegion, KVTarget
from proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.deltas import SampleDelta
from services.common.grpc_util import channel, error_from_rpc
from services.common.messages import (
    delta_from_proto,
    load_from_proto,
    prefill_result_from_proto,
    region_to_proto,
    target_from_proto,
    target_to_proto,
)
from services.common.params import params_to_proto
from services.common.prefill_result import PrefillResult
from services.common.workers import WorkerInfo, WorkerLoad


class WorkerClient(Protocol):
    async def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float, timeout: float
    ) -> KVTarget: ...

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, kv_target: KVTarget, timeout: float
    ) -> PrefillResult: ...

    def stream(self, request_id: str, timeout: float) -> AsyncIterator[SampleDelta]:
        """A CE's deltas after the first token (which `prefill` returned)."""
        ...

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout: float
    ) -> AsyncIterator[SampleDelta]: ...

    async def abort(self, request_id: str, prefill: bool) -> bool: ...

    async def connect_peer(self, agent_name: str, metadata: bytes, region: Optional[KVRegion] = None) -> None: ...

    async def stats(self, timeout: float) -> WorkerLoad: ...

    async def drain(self, timeout: float) -> int: ...

    async def close(self) -> None: ...


class GrpcWorkerClient:
    def __init__(self, info: WorkerInfo):
        self.name = f"{info.pool_name} worker {info.worker_id} ({info.address})"
        self._channel = channel(info.address)
        self._prefill = worker_pb2_grpc.PrefillStub(self._channel)
        self._decode = worker_pb2_grpc.DecodeStub(self._channel)
        self._worker = worker_pb2_grpc.WorkerStub(self._channel)

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        req = worker_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(params), lease_s=lease_s
        )
        try:
            reply = await self._decode.Reserve(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None
        return target_from_proto(reply.kv_target)

    async def prefill(self, request_id, prompt, params, kv_target, timeout) -> PrefillResult:
        req = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            kv_target=target_to_proto(kv_target),
        )
        try:
            reply = await self._prefill.Prefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None
        return prefill_result_from_proto(reply)

    async def stream(self, request_id, timeout) -> AsyncIterator[SampleDelta]:
        call = self._decode.Stream(worker_pb2.StreamRequest(request_id=request_id), timeout=timeout)
        async for msg in self._read(call):
            yield msg

    async def generate(self, request_id, prompt, params, timeout) -> AsyncIterator[SampleDelta]:
        req = worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(params))
        async for msg in self._read(self._decode.Generate(req, timeout=timeout)):
            yield msg

    async def _read(self, call) -> AsyncIterator[SampleDelta]:
        try:
            async for msg in call:
                yield delta_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None
        finally:
            call.cancel()

    async def abort(self, request_id, prefill: bool) -> bool:
        stub = self._prefill if prefill else self._decode
        try:
            return (await stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=5)).found
        except grpc.aio.AioRpcError:
            return False  # a dead worker holds nothing

    async def connect_peer(self, agent_name, metadata, region=None) -> None:
        req = worker_pb2.ConnectPeerRequest(
            agent_name=agent_name, agent_metadata=metadata, region=region_to_proto(region)
        )
        try:
            await self._prefill.ConnectPeer(req, timeout=30)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None

    async def stats(self, timeout) -> WorkerLoad:
        try:
            return load_from_proto(await self._worker.Stats(common_pb2.StatusRequest(), timeout=timeout))
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None

    async def drain(self, timeout) -> int:
        try:
            return (await self._worker.Drain(worker_pb2.DrainRequest(), timeout=timeout)).requests
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.name) from None

    async def close(self) -> None:
        await self._channel.close()


class LocalWorkerClient:
    """Calls a worker core in this process (same event loop)."""

    def __init__(self, core, name: Optional[str] = None):
        self.core = core
        self.name = name or f"worker {core.worker_id}"

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        return await self.core.reserve(request_id, prompt, params, lease_s)

    async def prefill(self, request_id, prompt, params, kv_target, timeout) -> PrefillResult:
        return await self.core.prefill(request_id, prompt, params, kv_target)

    def stream(self, request_id, timeout) -> AsyncIterator[SampleDelta]:
        return self.core.stream(request_id)

    def generate(self, request_id, prompt, params, timeout) -> AsyncIterator[SampleDelta]:
        return self.core.generate(request_id, prompt, params)

    async def abort(self, request_id, prefill: bool) -> bool:
        return await self.core.abort(request_id)

    async def connect_peer(self, agent_name, metadata, region=None) -> None:
        await self.core.connect_peer(agent_name, metadata, region)

    async def stats(self, timeout) -> WorkerLoad:
        return self.core.stats()

    async def drain(self, timeout) -> int:
        return self.core.drain()

    async def close(self) -> None:
        pass
