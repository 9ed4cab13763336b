"""The head's extra API processes (`deepinfer serve --api-workers N`): start, watch, restart, stop.

Each runs `api_process.main`, spawned (a fresh interpreter: nothing of the head's loop, threads or
Ray comes along). The head reads each one's pipe: "ready" once it serves, its workers after each
change, end-of-file when it dies. A process that dies is logged with its exit code and its admission
count zeroed (its requests died with it; the kernel stopped giving it connections when its sockets
closed), then it is started again after a pause that doubles while it keeps dying young (1 s to 30 s).
The head stops them (SIGTERM, then SIGKILL) before anything else when it stops; they are daemonic,
so they also end when the head's interpreter exits, and they leave by themselves if the head dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Optional

from services.gateway import api_process
from services.gateway.admission import SharedCounts

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0
_YOUNG_S = 60.0
"""A process that dies sooner than this after its start doubles the pause before the next start."""
_MAX_PAUSE_S = 30.0


@dataclass
class _Slot:
    index: int
    process: Any = None
    conn: Any = None
    """The read end of the process's pipe."""
    pid: int = 0
    ready: Optional[asyncio.Future] = None
    """True once the process serves, False if it ended first."""
    workers: frozenset = frozenset()
    """The worker ids its registry holds, as it last said."""
    started_at: float = 0.0
    young_deaths: int = 0


class ApiWorkers:
    def __init__(self, count: int, spec_for: Callable[[int], api_process.ApiProcessSpec]):
        """Processes 1..count-1; `spec_for(index)` describes each. Makes the shared admission counts
        (all `count` processes, the head's included) at once: the head's gateway needs them first."""
        self._spec_for = spec_for
        self._context = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="deepinfer-api-")
        self.counts_path = os.path.join(self._dir, "admission-counts")
        SharedCounts.create(self.counts_path, count)
        self.counts = SharedCounts(self.counts_path, 0)
        """The head's own slot (process 0)."""
        self._slots = [_Slot(i) for i in range(1, count)]
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    @property
    def pids(self) -> dict[int, int]:
        return {s.index: s.pid for s in self._slots}

    def spawn(self) -> None:
        for slot in self._slots:
            self._spawn(slot)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every process serves; RuntimeError if one ended first or the time ran out."""
        futures = [s.ready for s in self._slots]
        await asyncio.wait(futures, timeout=timeout_s)
        ended = [s.index for s in self._slots if s.ready.done() and not s.ready.result()]
        late = [s.index for s in self._slots if not s.ready.done()]
        if ended:
            raise RuntimeError(f"API process(es) {ended} ended before serving (their log says why)")
        if late:
            raise RuntimeError(f"API process(es) {late} did not start serving within {timeout_s:.0f} s")

    async def wait_synced(self, worker_ids: Callable[[], Collection[str]], timeout_s: float = 30.0) -> None:
        """Until every serving process's registry holds the workers that `worker_ids()` names (the
        head's); a warning (they still catch up) if the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            want = frozenset(worker_ids())
            behind = [s.index for s in self._slots if s.ready.done() and s.ready.result() and s.workers != want]
            if not behind:
                return
            if time.monotonic() > deadline:
                logger.warning("API process(es) %s have not yet copied the head's workers", behind)
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), min(0.5, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass

    # ---- one process ---------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=api_process.main,
            args=(self._spec_for(slot.index), writer),
            name=f"deepinfer-api-{slot.index}",
            daemon=True,
        )
        process.start()
        writer.close()  # the child holds the only write end: its death reads as end-of-file here
        slot.process, slot.conn, slot.pid = process, reader, process.pid
        slot.ready, slot.started_at, slot.workers = loop.create_future(), time.monotonic(), frozenset()
        loop.add_reader(reader.fileno(), self._on_message, slot)

    def _on_message(self, slot: _Slot) -> None:
        try:
            kind, value = slot.conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(slot.conn.fileno())
            slot.conn.close()
            self._track(self._on_exit(slot))
            return
        if kind == "ready":
            print(f"deepinfer: API process {slot.index} serving (pid {value})", flush=True)
            slot.ready.set_result(True)
        elif kind == "workers":
            slot.workers = frozenset(value)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _on_exit(self, slot: _Slot) -> None:
        process = slot.process
        await asyncio.to_thread(process.join, _STOP_GRACE_S)
        if not slot.ready.done():
            slot.ready.set_result(False)
        if self._stopping:
            return
        self.counts.reset(slot.index)
        young = time.monotonic() - slot.started_at < _YOUNG_S
        slot.young_deaths = slot.young_deaths + 1 if young else 0
        pause = min(_MAX_PAUSE_S, 2.0 ** max(0, slot.young_deaths - 1))
        logger.error(
            "API process %d (pid %d) exited with code %s; its requests are lost; starting it again in %.0f s",
            slot.index,
            slot.pid,
            process.exitcode,
            pause,
        )
        await asyncio.sleep(pause)
        if not self._stopping:
            self._spawn(slot)

    def _track(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- stop ----------------------------------------------------------------------------------
    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        alive = [s.process for s in self._slots if s.process is not None and s.process.is_alive()]
        for process in alive:
            process.terminate()
        await asyncio.gather(*(asyncio.to_thread(_join_or_kill, p) for p in alive))
        loop = asyncio.get_running_loop()
        for slot in self._slots:
            if slot.conn is not None and not slot.conn.closed:
                loop.remove_reader(slot.conn.fileno())
                slot.conn.close()
        self.counts.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _join_or_kill(process) -> None:
    process.join(_STOP_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join(5)
