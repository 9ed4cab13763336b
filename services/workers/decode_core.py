"""The core of a worker whose engine streams tokens: a decode engine (CE) or a NORMAL one.

A CE reserves KV blocks (`reserve`), receives the prompt's KV and first token from a PE, and
streams the rest: the first token reached the client with the PE's reply, so the stream starts
after it. A NORMAL engine prefills and decodes a request itself (`submit`, `generate`).

Deltas reach a router through its subscription (`open_subscription`): one batch per engine turn
holding every new delta of the requests it reserved or submitted under its subscriber id. A
request without a subscriber is read through its own stream (`stream`, `generate`): one message
per delta, for clients that read one request at a time.
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
from services.workers.streams import Outbox, OutputStreams


class DecodeCore(WorkerCore):
    def __init__(self, engine, worker_id: str = "", loop=None, stream_interval: int = 1):
        super().__init__(engine, worker_id, loop)
        self.streams = OutputStreams(stream_interval)
        self.subscribers: dict[str, Outbox] = {}
        self._num_relays = 0
        self._ending = False
        """The server is stopping: subscriptions end as they go idle."""

    # ---- subscriptions ------------------------------------------------------------------------
    def open_subscription(self, subscriber_id: str) -> Outbox:
        """A subscriber's outbox: requests may name `subscriber_id` from now on. Read it with
        `Outbox.batches()`; end it with `close_subscription`."""
        if not subscriber_id:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "a subscription needs a subscriber_id", "subscriber_id")
        if subscriber_id in self.subscribers:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"subscriber {subscriber_id!r} is already subscribed")
        outbox = self.subscribers[subscriber_id] = Outbox(subscriber_id)
        return outbox

    def close_subscription(self, outbox: Outbox) -> None:
        """The subscriber is gone (or is to be let go): abort every unfinished request it owns.
        Nothing more is sent on it, not even those aborts: its reader fails them itself."""
        if self.subscribers.get(outbox.owner) is outbox:
            del self.subscribers[outbox.owner]
        for request_id in list(outbox.requests):
            self.abort_soon(request_id)
        outbox.items.clear()
        outbox.close()

    def end_subscriptions(self) -> None:
        """End each subscription once it owns no unfinished request (now, or as its last one
        finishes), after what it has queued is sent: the server's graceful stop need not wait."""
        self._ending = True
        for outbox in list(self.subscribers.values()):
            if not outbox.requests:
                del self.subscribers[outbox.owner]
                outbox.close()

    def _outbox(self, subscriber_id: str) -> Optional[Outbox]:
        """The subscriber's outbox ("" = none: the request is read through its own stream)."""
        if not subscriber_id:
            return None
        outbox = self.subscribers.get(subscriber_id)
        if outbox is None:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"worker {self.worker_id} has no subscription {subscriber_id!r}")
        return outbox

    # ---- requests -----------------------------------------------------------------------------
    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lease_s: Optional[float] = None,
        subscriber_id: str = "",
    ) -> KVTarget:
        """CE: reserve blocks for prompt + 1 tokens; the target tells a PE where to write.
        `lease_s`: None takes the engine's `PDConfig.lease_s`. `subscriber_id`: whose
        subscription carries the deltas; "" = the request's own `stream`."""
        self._check_role(EngineType.COMPLETION, "Reserve")
        self._check_new(request_id)
        self.streams.open(request_id, self._outbox(subscriber_id), after_handoff=True)
        try:
            return await self.host.run(_reserve, request_id, params, prompt_token_ids, lease_s)
        except EngineError as e:
            self.streams.close(request_id)
            raise engine_error(e) from None

    async def renew_lease(self, request_id: str, lease_s: float) -> float:
        """CE: a heartbeat for a reservation whose prefill runs; its new end (wall clock), 0.0 when
        it is no longer waiting for its KV."""
        self._check_role(EngineType.COMPLETION, "RenewLease")
        return await self.host.run(_renew, request_id, lease_s)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        subscriber_id: str,
        images=(),
        resumed_tokens: int = 0,
    ) -> None:
        """NORMAL: admit a request whose deltas, from its first token, go to `subscriber_id`. CE: the
        same for a prompt it prefills itself (conditional disaggregation; RESOURCE_EXHAUSTED when its
        uncached part is too long or there is no room: prefill it on a PE instead). `images`: encoded files, one per image of the prompt (a NORMAL engine
        encodes them in process). `resumed_tokens`: the prompt's tail that is a migrated sample's output so far."""
        self._check_role((EngineType.NORMAL, EngineType.COMPLETION), "Submit")
        await self._add(request_id, prompt_token_ids, params, self._outbox(subscriber_id), images, resumed_tokens)

    def stream(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """CE: the deltas after the hand-off's first token; a reader that goes away aborts the request."""
        return self._relay(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images=(), resumed_tokens: int = 0
    ) -> AsyncIterator[SampleDelta]:
        """NORMAL (or a CE's local prefill): every delta of the request, from its first token, through its own stream."""
        self._check_role((EngineType.NORMAL, EngineType.COMPLETION), "Generate")
        await self._add(request_id, prompt_token_ids, params, None, images, resumed_tokens)
        async for delta in self._relay(request_id):
            yield delta

    async def _add(
        self, request_id, prompt_token_ids, params, outbox: Optional[Outbox], images=(), resumed_tokens: int = 0
    ) -> None:
        self._check_new(request_id)
        self.streams.open(request_id, outbox)
        mm = {"image": list(images)} if images else None
        try:
            await self.host.run(_add, request_id, params, prompt_token_ids, mm, resumed_tokens)
        except EngineError as e:
            self.streams.close(request_id)
            raise engine_error(e) from None

    def _check_new(self, request_id: str) -> None:
        """Refuse a second request under a live one's id before touching anything of the first
        (its stream would be replaced, then closed by the engine's refusal)."""
        if request_id in self.streams:
            raise ServiceError(
                ErrorCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use on worker {self.worker_id}"
            )

    def _check_role(self, engine_types, rpc: str) -> None:
        self.check_accepting()
        allowed = engine_types if isinstance(engine_types, tuple) else (engine_types,)
        if self.engine.engine_type not in allowed:
            names = " or ".join(t.name for t in allowed)
            raise ServiceError(
                ErrorCode.FAILED_PRECONDITION,
                f"worker {self.worker_id} runs a {self.engine.engine_type.name} engine; {rpc} needs {names}",
            )

    async def _relay(self, request_id: str) -> AsyncIterator[SampleDelta]:
        """A request's own stream until it finishes; a reader that goes away aborts the request."""
        finished = False
        deltas = self.streams.deltas(request_id)
        self._num_relays += 1
        try:
            async for delta in deltas:
                finished = delta.finished
                yield delta
        finally:
            self._num_relays -= 1
            await deltas.aclose()
            if not finished and request_id in self.streams:
                await self.abort(request_id)

    async def abort(self, request_id: str, unused: bool = False) -> bool:
        """End a request; `unused`: a CE reservation no PE was given, whose blocks are free at once."""
        if not unused:
            return await super().abort(request_id)
        found = self._forget(request_id)
        if self.host.alive:
            await self.host.run(_release_unused, request_id)
        return found

    # ---- the engine's side ------------------------------------------------------------------------
    def _forget(self, request_id: str) -> bool:
        return self.streams.close(request_id)

    def _on_turn(self, outputs: list, handoff_results: list) -> None:
        self.streams.push(outputs)
        if self._ending:
            self.end_subscriptions()

    def open_streams(self) -> int:
        return self._num_relays + self.streams.num_subscribed()


def _reserve(engine, request_id, params, prompt_token_ids, lease_s):
    return engine.reserve(request_id, params, prompt_token_ids, lease_s=lease_s)


def _renew(engine, request_id, lease_s):
    return engine.renew_reservation(request_id, lease_s)


def _release_unused(engine, request_id):
    engine.release_unused(request_id)


def _add(engine, request_id, params, prompt_token_ids, multi_modal_data, resumed_tokens):
    if engine.role.prefills_short_prompts:  # a CE: a prompt it prefills itself (conditional disaggregation)
        engine.add_local_prefill(request_id, params, prompt_token_ids, resumed_tokens=resumed_tokens)
    else:
        engine.add_request(
            request_id,
            params=params,
            prompt_token_ids=prompt_token_ids,
            multi_modal_data=multi_modal_data,
            resumed_tokens=resumed_tokens,
        )
