"""The token source in the prefill and decode roles: P/D through the real worker cores and
router with no KV moving and no transfer agent.

`TokenSourceCompletion` (a CE) reserves a request and "receives" it `handoff_delay_s` later, as
if a PE's notice had arrived: the first token (which the source can compute, being
deterministic) is appended and decoding starts. `TokenSourcePrompt` (a PE) prefills in one step
that emits the first token and completes the hand-off at once, reported through the outputs and
hand-off results the real PromptEngine uses.
"""

from __future__ import annotations

import time
from typing import Optional

from benchmarks.token_source import SourceRequest, TokenSourceConfig, TokenSourceEngine, token_source_config
from deepinfer_core.engine.handoff_result import HandoffResult
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.errors import InvalidRequestError, KVTargetRejected
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.messages import KVTarget


class TokenSourceCompletion(TokenSourceEngine):
    """A CE stand-in: `reserve` returns a KV target; `handoff_delay_s` later the request's first
    token "arrives" (as a PE's notice would bring it) and decoding starts."""

    def __init__(self, config: Optional[TokenSourceConfig] = None, handoff_delay_s: float = 0.005, **kwargs):
        super().__init__(config or token_source_config(EngineType.COMPLETION), **kwargs)
        self.handoff_delay_s = handoff_delay_s
        self._reserved: dict[str, float] = {}
        """Request id -> monotonic time its hand-off lands."""
        self.num_handoffs = 0

    def reserve(
        self,
        request_id: str,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        prompt: Optional[str] = None,
        lease_s: Optional[float] = None,
    ) -> KVTarget:
        stream = self.add_request(request_id, prompt, params, prompt_token_ids, enqueue=False)
        self._reserved[request_id] = time.monotonic() + self.handoff_delay_s
        bs = self.config.cache.block_size
        num_blocks = -(-(len(stream.prompt_token_ids) + 1) // bs)
        return KVTarget(
            request_id=request_id,
            engine_id=self.name,
            agent_metadata=b"",
            base_addr=0,
            num_blocks_total=self.config.cache.num_gpu_blocks,
            device_id=0,
            mem_type="DRAM",
            block_ids=list(range(num_blocks)),
            fingerprint="token-source",
            num_prompt_tokens=len(stream.prompt_token_ids),
            expires_at=time.time() + (self.config.pd.lease_s if lease_s is None else lease_s),
            layout="token source (no KV)",
        )

    def poll_handoffs(self) -> list[RequestOutput]:
        """Reservations whose hand-off time has come: first token in, request into the running set."""
        started, now = time.thread_time(), time.monotonic()
        landed = [r for r, at in self._reserved.items() if at <= now]
        outputs = []
        for request_id in landed:
            del self._reserved[request_id]
            stream = self.requests.get(request_id)
            if stream is None:
                continue
            self.num_tokens += stream.emit(1, now)
            self.num_handoffs += 1
            outputs.append(stream.output())
            if stream.finished:
                self._finish(stream)
            else:
                self._running[request_id] = stream
        self.cpu_seconds += time.thread_time() - started
        return outputs

    @property
    def awaits_handoffs(self) -> bool:
        return bool(self._reserved)

    def abort_request(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        super().abort_request(request_id)

    def _load(self) -> EngineLoad:
        load = super()._load()
        load.reservations = len(self._reserved)
        load.handoffs = self.num_handoffs
        return load


class TokenSourcePrompt(TokenSourceEngine):
    """A PE stand-in: a prefill is one step that emits the first token and completes the hand-off
    at once (reported through `pop_handoff_results`, as PromptEngine does)."""

    def __init__(self, config: Optional[TokenSourceConfig] = None, **kwargs):
        super().__init__(config or token_source_config(EngineType.PROMPT), **kwargs)
        self._results: list = []

    def connect_peer(self, name: str, metadata: bytes, region=None) -> None:
        """Nothing to connect: no KV moves."""

    def add_prefill(
        self,
        request_id: str,
        target: KVTarget,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        prompt: Optional[str] = None,
        multi_modal_data: Optional[dict] = None,
        resumed_tokens: int = 0,
    ) -> SourceRequest:
        """As `PromptEngine.add_prefill`; a token source takes no images."""
        if multi_modal_data:
            raise InvalidRequestError("the token source takes no images")
        params = (params or SamplingParams()).clone()
        params.max_tokens, params.min_tokens = 1, min(params.min_tokens, 1)
        stream = self.add_request(request_id, prompt, params, prompt_token_ids)
        if target.num_prompt_tokens != len(stream.prompt_token_ids):
            self.abort_request(request_id)
            raise KVTargetRejected(f"KV target for {request_id!r} is for {target.num_prompt_tokens} tokens")
        return stream

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for out in outputs:
            first = out.outputs[0].token_ids[0]
            self._results.append(HandoffResult(out.request_id, True, first, len(out.prompt_token_ids)))
        return outputs

    def pop_handoff_results(self) -> list:
        results, self._results = self._results, []
        return results
