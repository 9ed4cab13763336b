"""The store's I/O thread: file transfers, checksums and index updates, off the engine's steps.

The engine thread hands it jobs (`file_tier.SaveJob`, `LoadJob`) over slots it has pinned, and
collects results between steps; loads go before saves, since a prefill waits for them. Checksums
(hashlib, xxhash), file calls and SQLite release the GIL, so the engine's step keeps running.
An exception inside a job becomes a failed result, never a dead thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Optional

from deepinfer_core.kvstore.file_tier import FileTier, IOResult, LoadJob, SaveJob

logger = logging.getLogger(__name__)


class IOThread:
    def __init__(self, tier: FileTier, name: str):
        self.tier = tier
        self._loads: deque[LoadJob] = deque()
        self._saves: deque[SaveJob] = deque()
        self._wake = threading.Condition()
        self._results: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self._stop = False
        self.pending = 0
        """Jobs submitted and not yet collected (engine thread's count)."""
        self._thread = threading.Thread(target=self._run, name=f"{name}-kv-store-io", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob | LoadJob) -> None:
        with self._wake:
            (self._loads if isinstance(job, LoadJob) else self._saves).append(job)
            self._wake.notify()
        self.pending += 1

    def results(self, wait_s: float = 0.0) -> list[IOResult]:
        """Results finished so far; waits up to `wait_s` for the first when there is none yet."""
        out = []
        try:
            out.append(self._results.get(timeout=wait_s) if wait_s > 0 and self.pending else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            pass
        self.pending -= len(out)
        return out

    def _next(self) -> Optional[SaveJob | LoadJob]:
        with self._wake:
            while not (self._loads or self._saves or self._stop):
                self._wake.wait()
            if self._loads:
                return self._loads.popleft()
            if self._saves:
                return self._saves.popleft()
            return None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                result = self.tier.load(job) if isinstance(job, LoadJob) else self.tier.save(job)
            except Exception as e:  # a bug or an unexpected OS error: the job fails, the thread lives
                logger.exception("KV store %s job failed: %s", type(job).__name__, e)
                result = IOResult(job, failed=True, dropped=len(job.keys) if isinstance(job, SaveJob) else 0)
            self._results.put(result)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs (bounded by `timeout_s`), then stop."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout_s)
