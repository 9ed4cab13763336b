"""The SSE bodies of streamed /v1/completions and /v1/chat/completions: one event per delta the
gateway core yields (deltas that were waiting together already come as one), the usage chunk
when asked for, an error event if the stream fails after it started (a refusal before its first
delta is a status instead: `http_app`), then `[DONE]`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from services.common.errors import ServiceError
from services.gateway.chunks import DONE, StreamChunks, sse
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
    try:
        async for choice, delta in deltas:
            choices[choice.index] = choice
            yield chunks.completion(choice, delta)
            if lane is not None:
                lane.set_render(chunks, chat=False)
                lane = None
        if include_usage:
            yield chunks.usage(usage(list(choices.values())))
    except ServiceError as e:
        yield sse(service_error_body(e))
    except Exception as e:  # a bug: still end the stream with an error the client can read
        logger.exception("stream failed")
        yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
    yield DONE


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
    try:
        async for choice, delta in deltas:
            if choice.index not in choices:
                choices[choice.index] = choice
                yield chunks.chat_role(choice.index)
            event = chunks.chat(choice, delta)
            if event is not None:
                yield event
            if lane is not None:
                lane.set_render(chunks, chat=True)
                lane = None
        if include_usage:
            yield chunks.usage(usage(list(choices.values())))
    except ServiceError as e:
        yield sse(service_error_body(e))
    except Exception as e:  # a bug: still end the stream with an error the client can read
        logger.exception("stream failed")
        yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}"))
    yield DONE
