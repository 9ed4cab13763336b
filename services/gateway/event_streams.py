"""The SSE bodies of streamed /v1/completions and /v1/chat/completions: one event per delta the
gateway core yields (deltas that were waiting together already come as one), the usage chunk
when asked for, an error event if the stream fails after it started (a refusal before its first
delta is a status instead: `http_app`), then `[DONE]`. The event that finishes the last choice, the
usage or error event and `[DONE]` come as one item (`Last`), which the response sends with its end
in one write."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from services.common.errors import ServiceError
from services.gateway.chunks import DONE, Last, StreamChunks, sse
from services.gateway.core import Choice, GatewayCore, usage
from services.gateway.responses import Formatter, error_body, service_error_body

logger = logging.getLogger(__name__)


async def completion_events(
    core: GatewayCore, prompts: list[list[int]], params, fmt: Formatter, include_usage: bool, deltas=None, lane=None
) -> AsyncIterator[bytes]:
    """`deltas`: the request's `core.generate` stream, already started (None: started here).
    `lane`: the request's fast lane (`sse_lane.py`), given its chunk builder once the first event is out."""
    chunks = StreamChunks(fmt, chat=False)
    choices: dict[int, Choice] = {}
    deltas = deltas if deltas is not None else core.generate(prompts, params, fmt.id)
    end = _End(len(prompts) * params.n)
    try:
        async for choice, delta in deltas:
            choices[choice.index] = choice
            event = chunks.completion(choice, delta)
            if end.keeps(event, delta):
                continue
            yield event
            if lane is not None:
                lane.set_render(chunks, chat=False)
                lane = None
        if include_usage:
            end.add(chunks.usage(usage(list(choices.values()))))
    except ServiceError as e:
        end.add(sse(service_error_body(e)))
    except Exception as e:  # a bug: still end the stream with an error the client can read
        logger.exception("stream failed")
        end.add(sse(error_body(500, f"internal error: {type(e).__name__}: {e}")))
    yield end.last()


async def chat_events(
    core: GatewayCore,
    prompts: list[list[int]],
    params,
    fmt: Formatter,
    include_usage: bool,
    images=(),
    deltas=None,
    lane=None,
) -> AsyncIterator[bytes]:
    """`deltas`: the request's `core.generate` stream, already started (None: started here).
    `lane`: the request's fast lane (`sse_lane.py`), given its chunk builder once the role is out."""
    chunks = StreamChunks(fmt, chat=True)
    choices: dict[int, Choice] = {}
    deltas = deltas if deltas is not None else core.generate(prompts, params, fmt.id, images)
    end = _End(len(prompts) * params.n)
    try:
        async for choice, delta in deltas:
            if choice.index not in choices:
                choices[choice.index] = choice
                yield chunks.chat_role(choice.index)
            event = chunks.chat(choice, delta)
            if event is not None and not end.keeps(event, delta):
                yield event
            if lane is not None:
                lane.set_render(chunks, chat=True)
                lane = None
        if include_usage:
            end.add(chunks.usage(usage(list(choices.values()))))
    except ServiceError as e:
        end.add(sse(service_error_body(e)))
    except Exception as e:  # a bug: still end the stream with an error the client can read
        logger.exception("stream failed")
        end.add(sse(error_body(500, f"internal error: {type(e).__name__}: {e}")))
    yield end.last()


class _End:
    """The events that end a stream, sent as one `Last`: the event that finishes its last choice
    (held back: the stream ends right after it), the usage or an error event, and `[DONE]`."""

    __slots__ = ("_running", "_events")

    def __init__(self, choices: int):
        self._running = choices
        self._events: list[bytes] = []

    def keeps(self, event: bytes, delta) -> bool:
        """Whether `event` is the one that finishes the last running choice (then kept here)."""
        if not delta.finished:
            return False
        self._running -= 1
        if self._running:
            return False
        self._events.append(event)
        return True

    def add(self, event: bytes) -> None:
        self._events.append(event)

    def last(self) -> Last:
        self._events.append(DONE)
        return Last(b"".join(self._events))
