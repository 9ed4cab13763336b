"""The Ray actor that hosts one worker (one engine process of the cluster)."""

from __future__ import annotations

import logging

from services.common.workers import WorkerInfo, WorkerLoad
from services.workers.worker_server import WorkerServer, WorkerSpec


class WorkerActor:
    """Created by the controller with `ray.remote(WorkerActor).options(...)`; builds and
    serves its engine in `start()` and registers with the router."""

    def __init__(self, spec: WorkerSpec, log_level: str = "WARNING"):
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {spec.worker_id} %(name)s: %(message)s")
        self.server = WorkerServer(spec)

    def start(self) -> WorkerInfo:
        return self.server.start()

    def drain(self) -> int:
        return self.server.drain()

    def stats(self) -> WorkerLoad:
        return self.server.stats()

    def stop(self) -> None:
        self.server.stop()
