"""GatewayCore: what both front doors (HTTP and gRPC) share — model check, admission,
tokenizing and validating, streaming from the router, and the request-level metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.limits import RequestLimits
from services.common.stream_merge import merge
from services.gateway import validation
from services.metrics import definitions as m


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    """The model id clients ask for (`/v1/models`)."""
    max_model_len: int
    api_key: Optional[str] = None
    """When set, /v1/* and gRPC Generate need `Authorization: Bearer <key>`."""
    limits: RequestLimits = RequestLimits()
    """`max_n` and the end-to-end deadline (the router's too)."""
    max_concurrent_requests: int = 512
    """More requests in flight than this get 429."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Larger HTTP bodies get 413."""


@dataclass
class Choice:
    """One output stream of a request: prompt p, sample i (OpenAI index p * n + i)."""

    index: int
    prompt_tokens: int
    sample: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    cached_tokens: int = 0


class GatewayCore:
    def __init__(self, config: GatewayConfig, tokenizer, router):
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.vocab_size = tokenizer.vocab_size
        self.active = 0

    # ---- admission -------------------------------------------------------------------------
    def check_api_key(self, authorization: Optional[str]) -> None:
        import hmac

        if self.config.api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), self.config.api_key):
            raise ServiceError(ErrorCode.UNAUTHENTICATED, "missing or invalid API key (Authorization: Bearer <key>)")

    def admit(self) -> None:
        """Count a request in; `release()` when it ends. Over the limit: RESOURCE_EXHAUSTED."""
        self.check_capacity()
        self.active += 1

    def check_capacity(self) -> None:
        if self.active >= self.config.max_concurrent_requests:
            raise ServiceError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the server has {self.active} requests in flight (limit {self.config.max_concurrent_requests}); "
                "retry later",
            )

    def release(self) -> None:
        self.active -= 1

    async def ready(self) -> tuple[bool, str]:
        try:
            status = await self.router.status()
        except ServiceError as e:
            return False, e.message
        return status.ready, status.detail

    # ---- requests ----------------------------------------------------------------------------
    def prepare(self, prompts: list[list[int]], fields: dict[str, Any], param: str = "prompt") -> SamplingParams:
        params = validation.build_params(fields, self.config.limits.max_n)
        for ids in prompts:
            validation.check_length(ids, params, self.config.max_model_len, param)
        return params

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, request_id: Optional[str] = None
    ) -> AsyncIterator[tuple[Choice, SampleDelta]]:
        """Deltas of every (prompt, sample), each with its `Choice` (updated before it is yielded)."""
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        choices = {}
        streams = []
        for p, ids in enumerate(prompts):
            for i in range(params.n):
                choices[(p, i)] = Choice(p * params.n + i, len(ids), i)
            timeout_s = self.config.limits.request_timeout_s
            streams.append(self.router.generate(f"{request_id}-{p}", ids, params, timeout_s))
        first_at = last_at = None
        merged = merge(streams)
        try:
            async for p, delta in merged:
                choice = choices[(p, delta.index)]
                _apply(choice, delta)
                last_at = time.monotonic()
                if first_at is None and delta.token_ids:
                    first_at = last_at
                yield choice, delta
        except ServiceError as e:
            m.REQUEST_ERRORS.labels(e.code.name).inc()
            raise
        finally:
            await merged.aclose()
        self._observe(list(choices.values()), arrival, first_at, last_at)

    def _observe(self, choices: list[Choice], arrival: float, first_at, last_at) -> None:
        model = self.config.model_name
        reasons = {c.finish_reason for c in choices}
        for reason in reasons:
            m.REQUEST_SUCCESS.labels(model, reason or "unknown").inc()
        m.PROMPT_TOKENS.labels(model).inc(sum(c.prompt_tokens for c in choices if c.sample == 0))
        num_out = sum(len(c.token_ids) for c in choices)
        m.GENERATION_TOKENS.labels(model).inc(num_out)
        if first_at is None:
            return
        m.TIME_TO_FIRST_TOKEN.labels(model).observe(first_at - arrival)
        m.E2E_LATENCY.labels(model).observe(last_at - arrival)
        longest = max(len(c.token_ids) for c in choices)
        if longest > 1:
            m.TIME_PER_OUTPUT_TOKEN.labels(model).observe((last_at - first_at) / (longest - 1))


def _apply(choice: Choice, delta: SampleDelta) -> None:
    choice.token_ids += delta.token_ids
    choice.text += delta.text
    if delta.logprobs:
        choice.logprobs += delta.logprobs
    choice.cached_tokens = max(choice.cached_tokens, delta.num_cached_tokens)
    if delta.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.finish_reason in ("error", "abort", "preempted"):
            raise ServiceError(ErrorCode.UNAVAILABLE, f"generation failed: {delta.error or delta.finish_reason}")


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
