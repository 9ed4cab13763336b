"""The colocated worker: a NORMAL engine that prefills and decodes (serve --colocated)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.workers.base_core import WorkerCore
from services.workers.streams import OutputStreams


class ColocatedCore(WorkerCore):
    def __init__(self, engine, worker_id: str = "", loop=None):
        super().__init__(engine, worker_id, loop)
        self.streams = OutputStreams()

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
        finished = False
        self.num_open_streams += 1
        try:
            async for delta in self.streams.deltas(request_id):
                finished = delta.finished
                yield delta
        finally:
            self.num_open_streams -= 1
            if not finished and request_id in self.streams:
                await self.abort(request_id)

    def _forget(self, request_id: str) -> bool:
        return self.streams.close(request_id)

    def _on_turn(self, outputs: list, handoff_results: list) -> None:
        for out in outputs:
            self.streams.push(out)


def _add(engine, request_id, params, prompt_token_ids):
    engine.add_request(request_id, params=params, prompt_token_ids=prompt_token_ids)
