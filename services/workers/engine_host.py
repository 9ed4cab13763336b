"""EngineHost: one engine on a thread of its own, fed from an asyncio loop.

Nothing but the engine thread touches the engine. Other code queues calls (`call`) that run
between steps, and hears about outputs through one callback per loop turn, posted to the
asyncio loop (`on_turn(outputs, handoff_results)`), so request handlers never share state
with the engine thread. A loop turn is what the P/D harness does: apply calls, poll hand-off
notices (CE), step while there is work, collect hand-off results (PE).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from deepinfer_core.engine.load import EngineLoad
from services.common.workers import WorkerLoad

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
"""How long an idle engine thread sleeps waiting for a call."""
_POLL_WAIT_S = 0.001
"""How often a CE with open reservations polls for hand-off notices."""
_LOAD_REFRESH_S = 0.05
_LOCKSTEP_IDLE_WAIT_S = 0.01
"""An idle expert-parallel rank's wait between beats: its peers wait for it in the beat's all-reduce."""
_PEER_TIMEOUT_S = 10.0
"""An expert-parallel rank whose peer has not beaten for this long ends its process (the instance is
broken: the router drops every rank it can no longer reach, the controller replaces the instance)."""


class EngineHost:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_turn: Callable[[list, list], None]):
        self.engine = engine
        self.loop = loop
        self.on_turn = on_turn
        """Called on `loop` with (request outputs, hand-off results) after each turn that has any."""
        self.error: Optional[str] = None
        """Set when the engine raised: the host stops and reports unhealthy."""
        self.load = WorkerLoad()
        """A snapshot refreshed by the engine thread; safe to read anywhere."""
        self.step_started_at = 0.0
        self.num_steps = 0
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._load_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.name}", daemon=True)
        self.lockstep = None
        """An expert-parallel rank steps with its instance (`LockstepRank`): every turn is a beat."""
        if engine.group is not None:
            from deepinfer_core.distributed.lockstep import LockstepRank

            self.lockstep = LockstepRank(engine, engine.group, peer_timeout_s=_PEER_TIMEOUT_S)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout_s)
        if self.lockstep is not None:
            self.lockstep.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[..., Any], *args) -> concurrent.futures.Future:
        """Run `fn(engine, *args)` on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError(f"engine {self.engine.name} is not running: {self.error}"))
            return future
        self._calls.put((fn, args, future))
        return future

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """`call` awaited from the loop."""
        return await asyncio.wrap_future(self.call(fn, *args))

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        busy = False
        while not self._stop.is_set():
            try:
                self._apply_calls(wait_s=0.0 if busy else self._idle_wait())
                busy = self._turn()
            except Exception as e:  # the engine is broken: fail loudly, stop taking work
                logger.exception("engine %s failed", self.engine.name)
                self.error = f"{type(e).__name__}: {e}"
                if self.lockstep is not None:  # a broken instance: end the process, its peers and router see it
                    from deepinfer_core.distributed.lockstep import exit_instance

                    exit_instance(f"engine {self.engine.name}: {self.error}")
                break
        self._fail_pending_calls()

    def _idle_wait(self) -> float:
        if self.lockstep is not None:
            return _LOCKSTEP_IDLE_WAIT_S
        return _POLL_WAIT_S if self.engine.awaits_handoffs else _IDLE_WAIT_S

    def _apply_calls(self, wait_s: float) -> None:
        try:
            item = self._calls.get(timeout=wait_s) if wait_s > 0 else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine, *args))
                except Exception as e:
                    future.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _turn(self) -> bool:
        outputs = self.engine.poll_handoffs()
        if self.lockstep is not None:  # a beat whether this rank has work or not; raises if the instance failed
            self.step_started_at = time.monotonic()
            outputs += self.lockstep.step()
            stepped = self.lockstep.instance_busy
            self.num_steps += stepped
        else:
            stepped = self.engine.has_unfinished_requests()
            if stepped:
                self.step_started_at = time.monotonic()
                outputs += self.engine.step()
                self.num_steps += 1
        results = self.engine.pop_handoff_results()
        if outputs or results:
            self.loop.call_soon_threadsafe(self.on_turn, outputs, results)
        now = time.monotonic()
        if stepped or now - self._load_at > _LOAD_REFRESH_S:
            self._load_at = now
            self.load = snapshot_load(self.engine)
        return stepped or bool(outputs)

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[2].set_running_or_notify_cancel():
                item[2].set_exception(RuntimeError(f"engine {self.engine.name} stopped: {self.error}"))


_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(EngineLoad))


def snapshot_load(engine) -> WorkerLoad:
    """The engine's load, read on the engine thread (after every turn: its plain fields are copied
    as they are, not through `dataclasses.asdict`'s deep copy, which cost a worker 6% of its CPU)."""
    load = engine.load()
    return WorkerLoad(**{name: getattr(load, name) for name in _LOAD_FIELDS})
