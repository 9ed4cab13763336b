"""What every worker core shares: the engine host, draining, load, health, abort.

A core is the plain-Python side of a worker: tests drive it without gRPC or Ray. Its
methods run on the asyncio loop; the engine runs on the host's thread. Two cores exist:
`DecodeCore` (a CE, or a NORMAL engine) and `PrefillCore` (a PE); `roles.py` says which
pool gets which.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from services.common.errors import ErrorCode, ServiceError
from services.common.workers import WorkerLoad
from services.workers.engine_host import EngineHost


class WorkerCore:
    def __init__(self, engine, worker_id: str = "", loop: Optional[asyncio.AbstractEventLoop] = None):
        self.worker_id = worker_id or engine.name
        self.loop = loop or asyncio.get_running_loop()
        self.host = EngineHost(engine, self.loop, self._on_turn)
        self.draining = False

    @property
    def engine(self):
        return self.host.engine

    def start(self) -> None:
        self.host.start()

    def stop(self) -> None:
        self.host.stop()

    def end_subscriptions(self) -> None:
        """The server is about to stop: let go of readers that wait for no more work (a
        subscription holds its call open for as long as it lasts)."""

    # ---- requests -----------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        if not self.host.alive:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"worker {self.worker_id} is down: {self.host.error}")

    async def abort(self, request_id: str) -> bool:
        """End a request wherever the engine holds it; False when it held none."""
        found = self._forget(request_id)
        if self.host.alive:
            await self.host.run(_abort, request_id)
        return found

    def abort_soon(self, request_id: str) -> bool:
        """`abort` without waiting for the engine (from code that cannot await, such as a
        subscription's cleanup); the engine drops the request before its next step."""
        found = self._forget(request_id)
        if self.host.alive:
            self.host.call(_abort, request_id)
        return found

    def _forget(self, request_id: str) -> bool:
        """Drop the core's own record of a request; False when it had none."""
        return False

    def _on_turn(self, outputs: list, handoff_results: list) -> None:
        """Runs on the loop after each engine turn that produced something."""

    # ---- state ----------------------------------------------------------------------------
    def open_streams(self) -> int:
        """Requests whose output a reader is waiting for."""
        return 0

    def stats(self) -> WorkerLoad:
        return dataclasses.replace(
            self.host.load, worker_id=self.worker_id, draining=self.draining, open_streams=self.open_streams()
        )

    def health(self) -> tuple[bool, str]:
        if not self.host.alive:
            return False, f"engine down: {self.host.error}"
        return True, "draining" if self.draining else "ok"

    def drain(self) -> int:
        """Stop taking new work; returns the requests still held."""
        self.draining = True
        return self.stats().requests


def _abort(engine, request_id: str) -> None:
    engine.abort_request(request_id)
