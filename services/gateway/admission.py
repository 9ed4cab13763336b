"""Admission: requests in flight against `--max-concurrent-requests`, per request (never per token).

One policy (`Admission`) over two stores of counts. `LocalCounts` is one process's. `SharedCounts`
holds every API process of one server (`deepinfer serve --api-workers N`): a small file made by the
head before the processes start, one count per process, changed under `flock`. The kernel drops a
`flock` when its holder dies, so a process killed mid-update cannot wedge the others (a lock in shared
memory would stay held); one count per process lets the head zero a dead process's requests.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import Protocol

from services.metrics import definitions as m

_COUNT = 8
"""Bytes per count (a signed 64-bit integer)."""


class CountStore(Protocol):
    def add_if_below(self, limit: int) -> bool:
        """Count one in if the total is below `limit`; whether it was."""
        ...

    def remove(self) -> None: ...

    def total(self) -> int: ...


class LocalCounts:
    """The requests of this process alone."""

    def __init__(self):
        self.count = 0

    def add_if_below(self, limit: int) -> bool:
        if self.count >= limit:
            return False
        self.count += 1
        return True

    def remove(self) -> None:
        self.count -= 1

    def total(self) -> int:
        return self.count


class SharedCounts:
    """Process `index`'s count in the shared file at `path` (made by `create`); the limit is on the sum."""

    def __init__(self, path: str, index: int):
        self.index = index
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self._counts = memoryview(self._map).cast("q")

    @staticmethod
    def create(path: str, processes: int) -> None:
        with open(path, "wb") as f:
            f.write(bytes(_COUNT * processes))

    def add_if_below(self, limit: int) -> bool:
        with self._locked():
            if sum(self._counts) >= limit:
                return False
            self._counts[self.index] += 1
            return True

    def remove(self) -> None:
        with self._locked():
            self._counts[self.index] -= 1

    def total(self) -> int:
        return sum(self._counts)

    def of(self, index: int) -> int:
        """Process `index`'s own count."""
        return self._counts[index]

    def reset(self, index: int) -> None:
        """Zero process `index`'s count: it died, and its requests with it."""
        with self._locked():
            self._counts[index] = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        os.close(self._fd)


class Admission:
    """`try_enter()` counts a request in unless `limit` are in flight; `leave()` when it ends."""

    def __init__(self, limit: int, counts: CountStore | None = None, process: int = 0):
        self.limit = limit
        self.counts = counts if counts is not None else LocalCounts()
        self._admitted = m.API_PROCESS_REQUESTS.labels(str(process), "admitted")
        self._refused = m.API_PROCESS_REQUESTS.labels(str(process), "refused")

    def try_enter(self) -> bool:
        if self.counts.add_if_below(self.limit):
            self._admitted.inc()
            return True
        self._refused.inc()
        return False

    def leave(self) -> None:
        self.counts.remove()

    @property
    def in_flight(self) -> int:
        return self.counts.total()
