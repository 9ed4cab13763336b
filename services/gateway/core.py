"""GatewayCore: what both front doors (HTTP and gRPC) share — model check, admission,
tokenizing and validating, streaming from the router, and the request-level metrics.

Tokenizing and chat templating run on a small thread pool (`offload`), never on the event loop:
a prompt of megabytes takes the tokenizer seconds, and every other request would wait them out.
Small work (`is_small`) runs inline: the hop to a thread and back costs more than it does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.limits import RequestLimits
from services.common.stream_merge import FAILED, merge
from services.gateway import media, validation
from services.gateway.admission import Admission, Work
from services.metrics import definitions as m


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    """The model id clients ask for (`/v1/models`)."""
    max_model_len: int
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """When any is set, /v1/* and the gRPC API need `Authorization: Bearer <one of them>`."""
    limits: RequestLimits = RequestLimits()
    """`max_n` and the end-to-end deadline (the router's too)."""
    max_concurrent_requests: int = 512
    """More requests in flight than this get 429."""
    max_concurrent_sequences: int = 4096
    """More sequences (prompts x n, over every request) in flight than this get 429."""
    max_concurrent_prompt_tokens: int = 4 * 1024 * 1024
    """More prompt tokens in flight than this get 429."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Larger HTTP bodies get 413, larger gRPC messages RESOURCE_EXHAUSTED."""
    grpc_server: str = "h2"
    """The gRPC port's server: "h2" (`services/common/h2_grpc`, a message a few µs) or "grpcio"
    (`grpc.aio`, ~40-65 µs of CPU a streamed message)."""
    tokenizer_threads: int = 2
    """Threads that tokenize and render chat templates, off the event loop."""
    media: media.MediaLimits = media.MediaLimits()
    """What a request's images may be."""
    vision: Optional[media.VisionInfo] = None
    """The model's vision tower; None: image parts are refused."""

    @property
    def work_limits(self) -> Work:
        return Work(self.max_concurrent_requests, self.max_concurrent_sequences, self.max_concurrent_prompt_tokens)


class Choice:
    """One output stream of a request: prompt p, sample i (OpenAI index p * n + i)."""

    def __init__(self, index: int, prompt_tokens: int, sample: int = 0):
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.sample = sample
        self.token_ids: list[int] = []
        self._text: list[str] = []
        """The text as it came, joined when read: appending costs the same however long it grows."""
        self.text_len = 0
        """Characters of text so far."""
        self.logprobs: list = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.cached_tokens = 0

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def add(self, delta: SampleDelta) -> None:
        """Append a delta of this choice; a failed generation raises (UNAVAILABLE)."""
        self.token_ids += delta.token_ids
        if delta.text:
            self._text.append(delta.text)
            self.text_len += len(delta.text)
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.num_cached_tokens > self.cached_tokens:
            self.cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.finish_reason in FAILED:
                raise ServiceError(ErrorCode.UNAVAILABLE, f"generation failed: {delta.error or delta.finish_reason}")


class StreamClock:
    """When a request's first token and its latest delta came (TTFT, end-to-end, per-token metrics)."""

    __slots__ = ("first_at", "last_at")

    def __init__(self):
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None

    def tick(self, delta: SampleDelta) -> None:
        self.last_at = now = time.monotonic()
        if self.first_at is None and delta.token_ids:
            self.first_at = now


class GatewayCore:
    def __init__(self, config: GatewayConfig, tokenizer, router, admission: Optional[Admission] = None):
        """`admission`: the count of requests in flight (default: this process's alone)."""
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.vocab_size = tokenizer.vocab_size
        self.admission = admission or Admission(config.work_limits)
        self._pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")

    # ---- admission -------------------------------------------------------------------------
    def check_api_key(self, authorization: Optional[str]) -> None:
        import hmac

        keys = self.config.api_keys
        if not keys:
            return
        scheme, _, key = (authorization or "").partition(" ")
        given = key.strip().encode()
        # every key compared (no early exit): the time taken does not tell which one came close
        matches = [hmac.compare_digest(given, k.encode()) for k in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise ServiceError(ErrorCode.UNAUTHENTICATED, "missing or invalid API key (Authorization: Bearer <key>)")

    def admit(self, prompts: list[list[int]], params: SamplingParams) -> Work:
        """Count a request's work in; `release(work)` when it ends. More than a limit allows at all:
        INVALID_ARGUMENT (retrying cannot help); more than there is room for now: RESOURCE_EXHAUSTED
        with the seconds after which, at the recent drain rate, there should be room."""
        work = Work(1, len(prompts) * params.n, sum(map(len, prompts)))
        limits = self.admission.limits
        too_big = self.admission.too_big(work)
        if too_big == "sequences":
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT,
                f"the request asks for {work.sequences} sequences ({len(prompts)} prompt(s) x n={params.n}); "
                f"the server holds at most {limits.sequences} at once",
                "n",
            )
        if too_big == "prompt_tokens":
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT,
                f"the request has {work.prompt_tokens} prompt tokens; the server holds at most "
                f"{limits.prompt_tokens} at once",
                "prompt",
                http_status=413,
            )
        full = self.admission.try_enter(work)
        if full is not None:
            raise self._busy(work, full)
        return work

    def _busy(self, work: Work, kind: str) -> ServiceError:
        limit = getattr(self.admission.limits, kind)
        what = kind.replace("_", " ")
        return ServiceError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the server has {self.admission.in_flight(kind)} {what} in flight (limit {limit}); retry later",
            retry_after_s=self.admission.retry_after_s(work, kind),
        )

    def release(self, work: Work) -> None:
        self.admission.leave(work)

    @property
    def active(self) -> int:
        """Requests in flight (over every API process when the count is shared)."""
        return self.admission.in_flight()

    async def offload(self, fn, *args, small: bool = False):
        """`fn(*args)` on the tokenizer threads; `small`: here and now, work too small to be worth the hop."""
        if small:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode_prompts(self, prompt) -> list[list[int]]:
        max_len = self.config.max_model_len
        args = (prompt, self.tokenizer, self.vocab_size, max_len)
        return await self.offload(validation.encode_prompts, *args, small=small_prompt(prompt))

    async def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[bytes]]:
        """(prompt ids with image placeholders expanded, the checked images in order)."""
        max_len = self.config.max_model_len
        prompt = await self.offload(validation.encode_chat, messages, self.tokenizer, max_len, add_generation_prompt)
        images = await media.chat_images(messages, self.config.media, self.config.vision, self.config.model_name)
        if images:
            prompt = media.expand(prompt, self.config.vision, len(images))
        return prompt, images

    async def ready(self) -> tuple[bool, str]:
        try:
            status = await self.router.status()
        except ServiceError as e:
            return False, e.message
        return status.ready, status.detail

    # ---- requests ----------------------------------------------------------------------------
    def prepare(self, prompts: list[list[int]], fields: dict[str, Any], param: str = "prompt") -> SamplingParams:
        params = validation.build_params(fields, self.config.limits.max_n, self.vocab_size)
        for ids in prompts:
            validation.check_length(ids, params, self.config.max_model_len, param)
        return params

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: Optional[str] = None,
        images: Sequence[bytes] = (),
        lane=None,
    ) -> AsyncIterator[tuple[Choice, SampleDelta]]:
        """Deltas of every (prompt, sample), each with its `Choice` (updated before it is yielded).
        Several prompts are merged (each choice's waiting deltas as one); one prompt is read as it is.
        `images`: of a single (chat) prompt. `lane`: the request's fast lane (`gateway/sse_lane.py`),
        given the choice and the clock of a request with one prompt and one sample."""
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        n = params.n
        choices = [Choice(p * n + i, len(ids), i) for p, ids in enumerate(prompts) for i in range(n)]
        timeout_s = self.config.limits.request_timeout_s
        clock = StreamClock()
        if lane is not None and len(choices) == 1:
            lane.choice, lane.clock = choices[0], clock
            streams = [self.router.generate(f"{request_id}-0", prompts[0], params, timeout_s, images, lane=lane)]
        else:
            streams = [
                self.router.generate(f"{request_id}-{p}", ids, params, timeout_s, images)
                for p, ids in enumerate(prompts)
            ]
        many = len(streams) > 1
        stream = merge(streams) if many else streams[0]
        try:
            async for item in stream:
                p, delta = item if many else (0, item)
                choice = choices[p * n + delta.index]
                choice.add(delta)
                clock.tick(delta)
                yield choice, delta
        except ServiceError as e:
            m.REQUEST_ERRORS.labels(e.code.name).inc()
            if e.code is ErrorCode.RESOURCE_EXHAUSTED and e.retry_after_s is None:  # no engine had room
                e.retry_after_s = self.admission.drain_time_s(Work(1, len(choices), 0))
            raise
        finally:
            await stream.aclose()
        self._observe(choices, arrival, clock.first_at, clock.last_at)

    def _observe(self, choices: list[Choice], arrival: float, first_at, last_at) -> None:
        model = self.config.model_name
        reasons = {c.finish_reason for c in choices}
        for reason in reasons:
            m.labelled(m.REQUEST_SUCCESS, model, reason or "unknown").inc()
        m.labelled(m.PROMPT_TOKENS, model).inc(sum(c.prompt_tokens for c in choices if c.sample == 0))
        num_out = sum(len(c.token_ids) for c in choices)
        m.labelled(m.GENERATION_TOKENS, model).inc(num_out)
        if first_at is None:
            return
        m.labelled(m.TIME_TO_FIRST_TOKEN, model).observe(first_at - arrival)
        m.labelled(m.E2E_LATENCY, model).observe(last_at - arrival)
        longest = max(len(c.token_ids) for c in choices)
        if longest > 1:
            m.labelled(m.TIME_PER_OUTPUT_TOKEN, model).observe((last_at - first_at) / (longest - 1))


INLINE_PROMPT_ITEMS = 1024
"""A completion prompt of at most this many characters or token ids is encoded on the event loop
(tens of µs at most); a larger one goes to the tokenizer threads."""
INLINE_BODY_BYTES = 16 * 1024
"""An HTTP body of at most this many bytes is parsed on the event loop."""


def small_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_PROMPT_ITEMS
    if not isinstance(prompt, list) or len(prompt) > INLINE_PROMPT_ITEMS:
        return False
    if all(type(p) is int for p in prompt):
        return True
    return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt) <= INLINE_PROMPT_ITEMS


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices if c.sample == 0)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices if c.sample == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
