"""The SSE events of one streamed request, as bytes, from text serialized once per request.

An event is `data: <json>\\n\\n`, the JSON being exactly what `json.dumps(obj, ensure_ascii=False)`
gives for the OpenAI chunk object (default separators, keys in the API's order), with U+0085,
U+2028 and U+2029 escaped. Building that dict and running `json.dumps` per token costs more than
everything else on the token path, so the parts that never change within a request (id, object,
created, model, a choice's index) are serialized once; per chunk only the delta's text, finish and
logprobs are, each with the same encoder `json.dumps` uses for them.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from services.common.deltas import SampleDelta
from services.gateway.core import Choice
from services.gateway.responses import Formatter

_JSON = json.JSONEncoder(ensure_ascii=False)
"""`_JSON.encode(o) == json.dumps(o, ensure_ascii=False)`, without building an encoder per call."""
_string = json.encoder.encode_basestring
"""The string encoder of `_JSON` (C): a JSON string literal, non-ASCII characters kept."""

_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON leaves raw that common clients read as line ends (httpx's `iter_lines` and Python's
`str.splitlines` split on them), which would cut an event in two: a generated token can be one."""


def _one_line(s: str) -> str:
    if s.isascii() or not ("\x85" in s or "\u2028" in s or "\u2029" in s):
        return s  # nearly every token: `translate` would cost more than the rest of the chunk
    return s.translate(_LINE_BREAKS)


def dumps(obj: Any) -> str:
    """`json.dumps(obj, ensure_ascii=False)`, safe to put on one SSE line."""
    return _one_line(_JSON.encode(obj))


def sse(obj: Any) -> bytes:
    """One SSE event carrying `obj` (errors, usage: the once-per-request events)."""
    return f"data: {dumps(obj)}\n\n".encode()


def _text(s: str) -> str:
    return _one_line(_string(s))


def _scalar(v: Any) -> str:
    """A finish or stop reason: None, a string or a token id."""
    if v is None:
        return "null"
    if type(v) is str:
        return _text(v)
    return dumps(v)


DONE = b"data: [DONE]\n\n"


class Last(bytes):
    """A stream's last bytes, `[DONE]` at their end: the body's end goes out in the same write."""

    __slots__ = ()


_RUNNING = ', "logprobs": null, "finish_reason": null, "stop_reason": null}], "usage": null}\n\n'
"""The end of a chunk that is neither the last of its choice nor carries logprobs."""


class StreamChunks:
    """The chunks of one request of one endpoint: `chat.completion.chunk` or `text_completion`."""

    def __init__(self, fmt: Formatter, chat: bool):
        self.fmt = fmt
        self.object = "chat.completion.chunk" if chat else "text_completion"
        head = dumps({"id": fmt.id, "object": self.object, "created": fmt.created, "model": fmt.model})
        self._head = "data: " + head[:-1] + ', "choices": [{"index": '
        self._field = ', "delta": ' if chat else ', "text": '
        self._heads: dict[int, str] = {}
        """Choice index -> the event up to its first per-chunk field."""

    def _start(self, index: int) -> str:
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = f"{self._head}{index}{self._field}"
        return head

    def _end(self, logprobs: str, delta: SampleDelta) -> str:
        finish, stop = _scalar(delta.finish_reason), _scalar(delta.stop_reason)
        return f', "logprobs": {logprobs}, "finish_reason": {finish}, "stop_reason": {stop}}}], "usage": null}}\n\n'

    def completion(self, choice: Choice, delta: SampleDelta) -> bytes:
        """`{"index", "text", "logprobs", "finish_reason", "stop_reason"}` of `choice` after `delta`."""
        fmt = self.fmt
        text = _text(delta.text)
        if fmt.top_logprobs is None:
            if delta.finish_reason is None and delta.stop_reason is None:
                return (self._start(choice.index) + text + _RUNNING).encode()
            logprobs = "null"
        else:
            offset = choice.text_len - len(delta.text)
            logprobs = dumps(fmt.completion_logprobs(delta.logprobs or [], offset))
        return (self._start(choice.index) + text + self._end(logprobs, delta)).encode()

    def running_parts(self, index: int, chat: bool) -> tuple[bytes, bytes]:
        """The bytes before and after the JSON string of the text in a running chunk of choice
        `index` (`completion`'s or, for a delta with text, `chat`'s): what a native lane writes around it."""
        if chat:
            return (self._start(index) + '{"content": ').encode(), ("}" + _RUNNING).encode()
        return self._start(index).encode(), _RUNNING.encode()

    def chat_role(self, index: int) -> bytes:
        """The first chunk of a choice: the assistant's role, no content yet."""
        return (self._start(index) + '{"role": "assistant", "content": ""}' + _RUNNING).encode()

    def chat(self, choice: Choice, delta: SampleDelta) -> Optional[bytes]:
        """`{"index", "delta", "logprobs", "finish_reason", "stop_reason"}`; None when the delta brings
        no content, no logprobs and no finish."""
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return None
        content = '{"content": ' + _text(delta.text) + "}" if delta.text else "{}"
        if delta.finish_reason is None and delta.stop_reason is None and not delta.logprobs:
            return (self._start(choice.index) + content + _RUNNING).encode()
        logprobs = self.fmt.chat_logprobs(delta.logprobs) if delta.logprobs else None
        return (self._start(choice.index) + content + self._end(dumps(logprobs), delta)).encode()

    def usage(self, usage: dict[str, Any]) -> bytes:
        return sse(self.fmt.usage_chunk(self.object, usage))
