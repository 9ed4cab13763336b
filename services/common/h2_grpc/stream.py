"""What one end of an HTTP/2 connection keeps of one stream: its windows both ways, whether the
peer still sends on it, and the bytes that wait for the peer's window."""

from __future__ import annotations

import asyncio
from typing import Optional

from services.common.h2_grpc.http2 import RECEIVE_WINDOW


def wake(waiter: Optional[asyncio.Future]) -> None:
    """Resolve a stream's waiter (a reader's or a writer's), if one still waits."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Stream:
    """What the connection keeps of one stream (the server's and the client's calls are ones)."""

    def __init__(self, stream_id: int, send_window: int):
        """`send_window`: the peer's initial window for a stream (its INITIAL_WINDOW_SIZE)."""
        self.stream_id = stream_id
        self.send_window = send_window
        """What the peer's window for this stream lets this end send."""
        self.receive_window = RECEIVE_WINDOW
        """What the peer may still send on this stream before bytes are given back."""
        self.taken = 0
        """Received bytes taken and not yet given back to the peer's window."""
        self.remote_open = True
        """The peer has not ended its side of the stream."""
        self.pending = bytearray()
        """Message bytes the peer's windows hold back (sent as they open: `Http2Peer.pump`)."""
        self.peer_gone = False
        """The stream was reset, or the connection lost: nothing more goes to it."""

    def drained(self) -> None:
        """What waited for the peer's windows or the socket went out."""
