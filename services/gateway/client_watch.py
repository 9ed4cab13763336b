"""Whether the client of one HTTP request has left, as the server tells it (no polling).

Once a request's body is read, the server's `receive` returns only when the client disconnects (or
the response is over). One task per request waits on it (`ClientWatch`), for the whole request:

- while the request's own task waits for something (`until_gone`: the first delta of a stream, the
  whole answer of a non-streamed request), the client leaving cancels that wait, which aborts the
  request upstream, and the wait raises CANCELLED;
- while a stream is sent (`EventStream`), the same task is the listener that ends the stream.

Before, the first wait ran in a task of its own and asked the server every half second whether the
client was still there (a timer, a cancel scope and a `receive` per poll, for every request waiting
in a queue), and the stream started a second listener.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from services.common.errors import ErrorCode, ServiceError


class ClientWatch:
    def __init__(self, receive):
        self.task = asyncio.ensure_future(_until_disconnect(receive))
        """Done when the client has left (cancelled by `stop`)."""
        self._waiting = None

    def left(self) -> bool:
        return self.task.done() and not self.task.cancelled()

    async def until_gone(self, awaitable: Awaitable) -> Any:
        """`await awaitable` in this task; the client leaving first cancels it: raises CANCELLED."""
        if self.left():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: no warning that it was never awaited
            raise _gone()
        current = asyncio.current_task()
        self._waiting = current
        self.task.add_done_callback(self._cancel_waiting)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._waiting is None and self.left():  # our cancel, not the server's
                current.uncancel()
                raise _gone() from None
            raise
        finally:
            self.task.remove_done_callback(self._cancel_waiting)
            self._waiting = None

    def _cancel_waiting(self, task: asyncio.Future) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None and not task.cancelled():
            waiting.cancel()

    def stop(self) -> None:
        """The request is over: stop watching."""
        self.task.cancel()


def _gone() -> ServiceError:
    return ServiceError(ErrorCode.CANCELLED, "the client disconnected")


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
