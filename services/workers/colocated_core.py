"""The colocated worker: a NORMAL engine that prefills and decodes (serve --colocated)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.workers.streaming_core import StreamingCore


class ColocatedCore(StreamingCore):
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SampleDelta]:
        self.check_accepting()
        self.streams.open(request_id)
        try:
            await self.host.run(_add, request_id, params, prompt_token_ids)
        except ValueError as e:
            self.streams.close(request_id)
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        async for delta in self.relay(request_id):
            yield delta


def _add(engine, request_id, params, prompt_token_ids):
    engine.add_request(request_id, params=params, prompt_token_ids=prompt_token_ids)
