"""The core of a worker whose engine streams tokens: a decode engine (CE) or a NORMAL one.

A CE reserves KV blocks (`reserve`), receives the prompt's KV and first token from a PE, and
streams the rest (`stream`): the first token reached the client with the PE's reply, so the
stream starts after it. A NORMAL engine prefills and decodes a request itself (`generate`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Optional

from deepinfer_core.errors import EngineError
from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVTarget
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError, engine_error
from services.workers.base_core import WorkerCore
from services.workers.streams import OutputStreams


class DecodeCore(WorkerCore):
    def __init__(self, engine, worker_id: str = "", loop=None):
        super().__init__(engine, worker_id, loop)
        self.streams = OutputStreams()

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lease_s: Optional[float] = None
    ) -> KVTarget:
        """CE: reserve blocks for prompt + 1 tokens; the target tells a PE where to write.
        `lease_s`: None takes the engine's `PDConfig.lease_s`."""
        self._check_role(EngineType.COMPLETION, "Reserve")
        self.streams.open(request_id, after_handoff=True)
        try:
            return await self.host.run(_reserve, request_id, params, prompt_token_ids, lease_s)
        except EngineError as e:
            self.streams.close(request_id)
            raise engine_error(e) from None

    def stream(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """CE: the deltas after the hand-off's first token; a reader that goes away aborts the request."""
        return self._relay(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SampleDelta]:
        """NORMAL: every delta of the request, from its first token."""
        self._check_role(EngineType.NORMAL, "Generate")
        self.streams.open(request_id)
        try:
            await self.host.run(_add, request_id, params, prompt_token_ids)
        except EngineError as e:
            self.streams.close(request_id)
            raise engine_error(e) from None
        async for delta in self._relay(request_id):
            yield delta

    def _check_role(self, engine_type: EngineType, rpc: str) -> None:
        self.check_accepting()
        if self.engine.engine_type != engine_type:
            raise ServiceError(
                ErrorCode.FAILED_PRECONDITION,
                f"worker {self.worker_id} runs a {self.engine.engine_type.name} engine; {rpc} needs {engine_type.name}",
            )

    async def _relay(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """The request's deltas until it finishes; a reader that goes away aborts the request."""
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


def _reserve(engine, request_id, params, prompt_token_ids, lease_s):
    return engine.reserve(request_id, params, prompt_token_ids, lease_s=lease_s)


def _add(engine, request_id, params, prompt_token_ids):
    engine.add_request(request_id, params=params, prompt_token_ids=prompt_token_ids)
