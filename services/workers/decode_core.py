"""The decode worker (CE): reserve KV blocks, then stream the request's tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepinfer_core.pd.completion_engine import KVCapacityError
from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.workers.streaming_core import StreamingCore


class DecodeCore(StreamingCore):
    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lease_s: float
    ) -> bytes:
        """Reserve blocks for prompt + 1 tokens; returns the KV target (KVTarget.to_bytes())."""
        self.check_accepting()
        self.streams.open(request_id)
        try:
            target = await self.host.run(_reserve, request_id, params, prompt_token_ids, lease_s)
        except KVCapacityError as e:
            self.streams.close(request_id)
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, str(e)) from None
        except ValueError as e:
            self.streams.close(request_id)
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        return target.to_bytes()

    async def stream(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """Deltas from the hand-off on; a reader that goes away aborts the request."""
        async for delta in self.relay(request_id):
            yield delta


def _reserve(engine, request_id, params, prompt_token_ids, lease_s):
    return engine.reserve(request_id, params, prompt_token_ids, lease_s=lease_s)
