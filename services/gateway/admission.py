"""Admission by work: requests, sequences (prompts x n) and prompt tokens in flight, each against
its limit (`--max-concurrent-requests`, `--max-concurrent-sequences`, `--max-concurrent-prompt-tokens`).

One policy (`Admission`) over two stores of counts. `LocalCounts` is one process's. `SharedCounts`
holds every API process of one server (`deepinfer serve --api-workers N`): a small file made by the
head before the processes start, one row of counts per process, changed under `flock`. The kernel
drops a `flock` when its holder dies, so a process killed mid-update cannot wedge the others (a lock
in shared memory would stay held); one row per process lets the head zero a dead process's work.

Each row also counts the work that has finished, ever: the drain rate of the last half minute,
read from it, says how long a refused client should wait (`Retry-After`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import math
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Protocol

from services.metrics import definitions as m

_KINDS = ("requests", "sequences", "prompt_tokens")
_ROW = 2 * len(_KINDS)
"""Counts per process: the work in flight, then the work finished so far, one of each per kind."""
_COUNT = 8
"""Bytes per count (a signed 64-bit integer)."""


@dataclass(frozen=True)
class Work:
    """What one request asks of the server, or a limit on the sum of them."""

    requests: int = 1
    sequences: int = 1
    """Prompts x n: each is a sequence some decode engine holds until it ends."""
    prompt_tokens: int = 0

    @property
    def counts(self) -> tuple[int, int, int]:
        """One number per kind, in `_KINDS`' order (`dataclasses.astuple` costs more than a request's
        admission itself)."""
        return (self.requests, self.sequences, self.prompt_tokens)


class CountStore(Protocol):
    def add_if_fits(self, work: tuple[int, ...], limits: tuple[int, ...]) -> Optional[int]:
        """Count `work` in if every total stays within `limits`; else the index of a kind that would not."""
        ...

    def remove(self, work: tuple[int, ...]) -> None:
        """Count `work` out, and as finished."""
        ...

    def totals(self) -> list[int]:
        """In flight, then finished, per kind (a row summed over the processes)."""
        ...


def _fits(totals: list[int], work: tuple[int, ...], limits: tuple[int, ...]) -> Optional[int]:
    for k, (have, want, limit) in enumerate(zip(totals, work, limits)):
        if have + want > limit:
            return k
    return None


class LocalCounts:
    """The work of this process alone."""

    def __init__(self):
        self.row = [0] * _ROW

    def add_if_fits(self, work, limits) -> Optional[int]:
        full = _fits(self.row, work, limits)
        if full is None:
            for k, v in enumerate(work):
                self.row[k] += v
        return full

    def remove(self, work) -> None:
        for k, v in enumerate(work):
            self.row[k] -= v
            self.row[len(_KINDS) + k] += v

    def totals(self) -> list[int]:
        return list(self.row)


class SharedCounts:
    """Process `index`'s row in the shared file at `path` (made by `create`); limits are on the sums."""

    def __init__(self, path: str, index: int):
        self.index = index
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self._counts = memoryview(self._map).cast("q")
        self._processes = len(self._counts) // _ROW

    @staticmethod
    def create(path: str, processes: int) -> None:
        with open(path, "wb") as f:
            f.write(bytes(_COUNT * _ROW * processes))

    def add_if_fits(self, work, limits) -> Optional[int]:
        with self._locked():
            full = _fits(self.totals(), work, limits)
            if full is None:
                for k, v in enumerate(work):
                    self._counts[self.index * _ROW + k] += v
            return full

    def remove(self, work) -> None:
        base = self.index * _ROW
        with self._locked():
            for k, v in enumerate(work):
                self._counts[base + k] -= v
                self._counts[base + len(_KINDS) + k] += v

    def totals(self) -> list[int]:
        c = self._counts
        return [sum(c[p * _ROW + k] for p in range(self._processes)) for k in range(_ROW)]

    def of(self, index: int) -> int:
        """Process `index`'s own requests in flight."""
        return self._counts[index * _ROW]

    def reset(self, index: int) -> None:
        """Zero process `index`'s work in flight: it died, and its requests with it."""
        with self._locked():
            for k in range(len(_KINDS)):
                self._counts[index * _ROW + k] = 0

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


_WINDOW_S = 30.0
"""The drain rate is measured over this much recent time."""
_SAMPLE_EVERY_S = 0.5
_RETRY_MIN_S, _RETRY_MAX_S = 1, 60
_RETRY_UNKNOWN_S = 5
"""Retry-After when nothing finished within the window: a guess, not a promise."""


class DrainRate:
    """Finished work per second over the last `_WINDOW_S`, from samples of the finished totals."""

    def __init__(self):
        self._samples: collections.deque[tuple[float, list[int]]] = collections.deque()

    def observe(self, totals: list[int], now: float) -> None:
        if self._samples and now - self._samples[-1][0] < _SAMPLE_EVERY_S:
            return
        self._samples.append((now, totals[len(_KINDS) :]))
        while len(self._samples) > 2 and now - self._samples[1][0] > _WINDOW_S:
            self._samples.popleft()

    def per_second(self, kind: int, totals: list[int], now: float) -> float:
        if not self._samples:
            return 0.0
        then, finished = self._samples[0]
        span = now - then
        return (totals[len(_KINDS) + kind] - finished[kind]) / span if span > 0 else 0.0


class Admission:
    """`try_enter(work)` counts a request's work in unless a limit would be passed; `leave(work)`
    when it ends."""

    def __init__(self, limits: Work, counts: CountStore | None = None, process: int = 0):
        self.limits = limits
        self.counts = counts if counts is not None else LocalCounts()
        self.drain = DrainRate()
        self._admitted = m.API_PROCESS_REQUESTS.labels(str(process), "admitted")
        self._refused = m.API_PROCESS_REQUESTS.labels(str(process), "refused")

    def too_big(self, work: Work) -> Optional[str]:
        """The kind of work that `work` alone asks more of than its limit (never admitted), or None."""
        full = _fits([0] * len(_KINDS), work.counts, self.limits.counts)
        return None if full is None else _KINDS[full]

    def try_enter(self, work: Work = Work()) -> Optional[str]:
        """None when counted in; else the kind of work whose limit is reached."""
        full = self.counts.add_if_fits(work.counts, self.limits.counts)
        self.drain.observe(self.counts.totals(), time.monotonic())
        if full is None:
            self._admitted.inc()
            return None
        self._refused.inc()
        return _KINDS[full]

    def leave(self, work: Work = Work()) -> None:
        self.counts.remove(work.counts)
        self.drain.observe(self.counts.totals(), time.monotonic())

    def retry_after_s(self, work: Work, kind: str) -> int:
        """Whole seconds until, at the recent drain rate, `work` of `kind` would fit."""
        k = _KINDS.index(kind)
        totals, now = self.counts.totals(), time.monotonic()
        excess = totals[k] + work.counts[k] - self.limits.counts[k]
        rate = self.drain.per_second(k, totals, now)
        seconds = math.ceil(excess / rate) if rate > 0 else _RETRY_UNKNOWN_S
        return max(_RETRY_MIN_S, min(_RETRY_MAX_S, seconds))

    def drain_time_s(self, work: Work) -> int:
        """Whole seconds in which, at the recent drain rate, as many sequences as `work` has finish:
        the wait to suggest when the engines (not these limits) had no room."""
        totals = self.counts.totals()
        rate = self.drain.per_second(_KINDS.index("sequences"), totals, time.monotonic())
        seconds = math.ceil(work.sequences / rate) if rate > 0 else _RETRY_UNKNOWN_S
        return max(_RETRY_MIN_S, min(_RETRY_MAX_S, seconds))

    def in_flight(self, kind: str = "requests") -> int:
        return self.counts.totals()[_KINDS.index(kind)]
