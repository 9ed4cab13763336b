"""TokenSourceEngine: an engine stand-in that computes nothing and emits tokens on a clock.

It offers the surface a worker host drives (`services/workers/engine_host.py` and the worker
cores): `add_request`, `abort_request`, `has_unfinished_requests`, `step`, `poll_handoffs`,
`pop_handoff_results`, `awaits_handoffs`, `load`, and the `name`, `engine_type`, `config`,
`agent` and `requests` a worker reads. With it, a worker's service layer (gRPC stream, router,
gateway) can be measured without a model: every CPU cycle the worker spends beyond the token
source's own few microseconds is the service layer's.

A step sleeps until `step_period_s` after the previous step began (a device step blocks its
thread the same way), then gives each of up to `max_batch` running requests `tokens_per_step`
tokens, and reports cumulative outputs as `LLMEngine.step` does. A request ends with
finish_reason 'length' at its max_tokens (None: up to max_model_len); stop strings, EOS and
n > 1 are not modelled (the router splits n before a worker sees it).

Tokens are a deterministic function of the prompt's first id and the position, so a client can
check every delivered token: token j of a request whose prompt starts with `s` is
`(s + j) % VOCAB_SIZE`, its text `WORDS[id]` (" w<id>"). The monotonic time of each token's
step end is kept per request (`take_emissions`) to measure the latency the services add.

The prefill and decode roles are in `service_layer_pd_source.py`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from deepinfer_core.config import CacheConfig, PDConfig, SchedulerConfig
from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.errors import FinishReason, InvalidRequestError
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.roles import EngineType, role_profile
from deepinfer_core.sampling_params import SamplingParams

VOCAB_SIZE = 256
WORDS = tuple(f" w{i}" for i in range(VOCAB_SIZE))
"""Each token's text: one short word with its leading space, so the text splits back into ids."""


def token_id(seed: int, position: int) -> int:
    """The token a request emits at `position`; `seed` is its prompt's first id."""
    return (seed + position) % VOCAB_SIZE


def expected_tokens(prompt_token_ids: list[int], count: int) -> list[int]:
    return [token_id(prompt_token_ids[0], j) for j in range(count)]


def ids_of_text(text: str) -> list[int]:
    """The token ids a text made of `WORDS` spells."""
    return [int(word[1:]) for word in text.split()]


@dataclass(frozen=True)
class TokenSourceConfig:
    """The parts of `EngineConfig` a worker reads (real config types, so their checks apply)."""

    engine_type: EngineType
    scheduler: SchedulerConfig
    cache: CacheConfig
    pd: PDConfig = PDConfig()


def token_source_config(
    engine_type: EngineType = EngineType.NORMAL,
    max_model_len: int = 4096,
    max_num_seqs: int = 4096,
    block_size: int = 16,
    num_blocks: int = 1 << 20,
) -> TokenSourceConfig:
    """Defaults sized so that the router never turns a benchmark request away for KV room."""
    scheduler = SchedulerConfig(
        engine_type,
        max_model_len,
        max_num_batched_tokens=max_model_len,
        max_num_seqs=max_num_seqs,
        stop_preempted_request=role_profile(engine_type).requires_stop_preempted_request,
    )
    return TokenSourceConfig(engine_type, scheduler, CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks))


@dataclass
class SourceRequest:
    """One request the token source holds."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_at: list[float] = field(default_factory=list)
    """Monotonic time of the step end that emitted each token."""

    @property
    def finished(self) -> bool:
        return len(self.token_ids) >= self.max_tokens

    def emit(self, count: int, now: float) -> int:
        """Append up to `count` tokens; returns how many."""
        seed, start = self.prompt_token_ids[0], len(self.token_ids)
        new = [token_id(seed, j) for j in range(start, min(start + count, self.max_tokens))]
        self.token_ids += new
        self.text += "".join(WORDS[t] for t in new)
        self.emitted_at += [now] * len(new)
        return len(new)

    def output(self) -> RequestOutput:
        """Cumulative, as the real engine reports: fresh lists, so a reader may keep them."""
        done = self.finished
        sample = CompletionOutput(
            0, self.text, list(self.token_ids), finish_reason=FinishReason.LENGTH.value if done else None
        )
        return RequestOutput(self.request_id, None, self.prompt_token_ids, [sample], finished=done)


class TokenSourceEngine:
    """A NORMAL engine stand-in (prefill and decode in one; the first token comes one step after admission)."""

    agent = None
    """No KV transfer agent: nothing to connect to."""
    group = None
    """Not a rank of an expert-parallel instance."""

    def __init__(
        self,
        config: Optional[TokenSourceConfig] = None,
        step_period_s: float = 0.02,
        tokens_per_step: int = 1,
        max_batch: Optional[int] = None,
        name: str = "",
        record_emissions: bool = True,
    ):
        self.config = config or token_source_config()
        self.engine_type = self.config.engine_type
        self.role = role_profile(self.engine_type)
        self.name = name or f"token_source_{self.engine_type.name}"
        self.step_period_s = step_period_s
        self.tokens_per_step = tokens_per_step
        self.max_batch = max_batch or self.config.scheduler.max_num_seqs
        """Requests advanced per step; the rest wait in admission order."""
        self.record_emissions = record_emissions
        self.requests: dict[str, SourceRequest] = {}
        """Every request held: waiting, running, or (CE) reserved."""
        self._waiting: deque[str] = deque()
        self._running: dict[str, SourceRequest] = {}
        self._last_step_at = 0.0
        self._emissions: dict[str, list[float]] = {}
        self._emissions_lock = threading.Lock()
        """`take_emissions` may run on another thread than the engine's."""
        self.num_steps = 0
        self.num_tokens = 0
        """Tokens emitted since start (all requests)."""
        self.cpu_seconds = 0.0
        """CPU the token source itself has spent (its calls, on the engine thread): what a worker
        spends beyond it is the service layer's."""

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Optional[str] = None,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        arrival_time: Optional[float] = None,
        enqueue: bool = True,
        multi_modal_data: Optional[dict] = None,
        resumed_tokens: int = 0,
    ) -> SourceRequest:
        """Admit a request given as token ids. Raises InvalidRequestError as the real engine does
        for a reused id, an empty or too long prompt; also for text prompts, images and n > 1.
        `resumed_tokens` (a migrated sample's output so far) changes nothing: it takes no images."""
        started = time.thread_time()
        try:
            return self._admit_request(request_id, params, prompt_token_ids, enqueue, multi_modal_data)
        finally:
            self.cpu_seconds += time.thread_time() - started

    def _admit_request(self, request_id, params, prompt_token_ids, enqueue, multi_modal_data) -> SourceRequest:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None or multi_modal_data:
            raise InvalidRequestError("the token source takes prompt token ids only")
        if params.n != 1:
            raise InvalidRequestError("the token source takes one sample per request (n=1)")
        ids = [int(t) for t in prompt_token_ids]
        limit = self.config.scheduler.max_model_len
        if not ids or len(ids) >= limit:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; it needs 1 to {limit - 1}")
        room = limit - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stream = SourceRequest(request_id, ids, max_tokens)
        self.requests[request_id] = stream
        if enqueue:
            self._waiting.append(request_id)
        return stream

    def abort_request(self, request_id: str) -> None:
        stream = self.requests.pop(request_id, None)
        self._running.pop(request_id, None)
        if stream is not None:
            self._retire(stream)  # a waiting id is skipped when it comes up

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._pace()
        started = time.thread_time()
        self._admit()
        now = time.monotonic()
        outputs = []
        for stream in list(self._running.values()):
            self.num_tokens += stream.emit(self.tokens_per_step, now)
            outputs.append(stream.output())
            if stream.finished:
                self._finish(stream)
        self.num_steps += 1
        self.cpu_seconds += time.thread_time() - started
        return outputs

    def _pace(self) -> None:
        """Sleep out the rest of the step period (steps that overran start at once: no catch-up burst)."""
        wait = self._last_step_at + self.step_period_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last_step_at = time.monotonic()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            request_id = self._waiting.popleft()
            stream = self.requests.get(request_id)
            if stream is not None and request_id not in self._running:
                self._running[request_id] = stream

    def _finish(self, stream: SourceRequest) -> None:
        self._running.pop(stream.request_id, None)
        self.requests.pop(stream.request_id, None)
        self._retire(stream)

    def _retire(self, stream: SourceRequest) -> None:
        if self.record_emissions and stream.emitted_at:
            with self._emissions_lock:
                self._emissions[stream.request_id] = stream.emitted_at

    def take_emissions(self) -> dict[str, list[float]]:
        """Emission times (request id -> one monotonic time per token) of every request that ended
        since the last call, and so far of those still held. Safe from any thread."""
        with self._emissions_lock:
            taken, self._emissions = self._emissions, {}
        for stream in list(self.requests.values()):  # one C-level copy: safe beside the engine thread
            if stream.emitted_at and stream.request_id not in taken:
                taken[stream.request_id] = list(stream.emitted_at)
        return taken

    # ---- what a host drives between steps -----------------------------------------------------
    def poll_handoffs(self) -> list[RequestOutput]:
        return []

    def pop_handoff_results(self) -> list:
        return []

    @property
    def awaits_handoffs(self) -> bool:
        return False

    def load(self) -> EngineLoad:
        """The host reads it after every step: its cost is the source's, like the step's."""
        started = time.thread_time()
        try:
            return self._load()
        finally:
            self.cpu_seconds += time.thread_time() - started

    def _load(self) -> EngineLoad:
        num_blocks = self.config.cache.num_gpu_blocks
        kv_tokens = sum(len(s.prompt_token_ids) + len(s.token_ids) for s in self._running.values())
        used = -(-kv_tokens // self.config.cache.block_size)
        return EngineLoad(
            queued_prompt_tokens=sum(
                len(self.requests[r].prompt_token_ids) for r in self._waiting if r in self.requests
            ),
            running_requests=len(self._running),
            waiting_requests=len(self._waiting),
            total_kv_tokens=kv_tokens,
            kv_usage=used / num_blocks,
            free_blocks=num_blocks - used,
            num_blocks=num_blocks,
            requests=len(self.requests),
        )
