"""What the front door knows of uvicorn's HTTP/1.1 request-response cycle (httptools), and the one
thing it does with it beyond the fast lane (`sse_lane.py`): a streamed response's head and first
event in one write.

uvicorn's `send` writes the head of a response as soon as it is given `http.response.start`, and
each body chunk in a write of its own. A streamed completion's first event is ready when its head
is (`http_app._started` waits for the first delta before answering), so the two can leave in one
segment. On the 2-core machine a server spends 9-13 µs of CPU on each event it writes
(`benchmarks/sse_floor.py`), most of it in the kernel: over loopback the receiver's TCP processing
and wake-up run on the sender's CPU.

Only the cycle of `_UVICORN_CYCLE` is used; with any other server (h11, a test client) the caller
sends the head and the event as usual.
"""

from __future__ import annotations

from typing import Optional

_UVICORN_CYCLE = "uvicorn.protocols.http.httptools_impl"
"""The uvicorn protocol whose cycle the lanes write to: its body framing is `send`'s
(`b"%x\\r\\n" % len(body) + body + b"\\r\\n"`, one `transport.write`). Under h11 (`--http h11`) the
framing is h11's own, and every event goes through `send`."""


def cycle_of(send) -> Optional[object]:
    """The httptools cycle whose own `send` this is (None: another server's, or a wrapper)."""
    cycle = getattr(send, "__self__", None)
    return cycle if type(cycle).__module__ == _UVICORN_CYCLE else None


def chunked_cycle(send) -> Optional[object]:
    """`cycle_of(send)` once its response has started with a chunked body that is not a HEAD's: the
    lanes may then write chunks to its transport as `send` would."""
    cycle = cycle_of(send)
    if cycle is None or cycle.chunked_encoding is not True or not cycle.response_started:
        return None
    return None if cycle.scope.get("method") == "HEAD" else cycle


class _Kept:
    """Stands in for a cycle's transport while `send` writes a response head: keeps the bytes."""

    __slots__ = ("parts",)

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)


async def start_with_chunk(send, start: dict, chunk: bytes) -> bool:
    """Send `start` and then `chunk` as a body part with more to come, in one write; False (nothing
    sent) where `send` is not an httptools cycle's that can take it now: the caller sends both."""
    cycle = cycle_of(send)
    if cycle is None or cycle.response_started or cycle.disconnected or cycle.flow.write_paused:
        return False
    if cycle.scope.get("method") == "HEAD" or not chunk:
        return False
    transport, kept = cycle.transport, _Kept()
    cycle.transport = kept  # `send` builds the head as ever (default headers, keep-alive, framing)
    try:
        await send(start)  # does not wait: writing is not paused
    finally:
        cycle.transport = transport
    head = b"".join(kept.parts)
    if cycle.chunked_encoding is not True:  # a length was given: the body is framed by `send` alone
        transport.write(head)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    else:
        transport.write(b"%b%x\r\n%b\r\n" % (head, len(chunk), chunk))
    return True
