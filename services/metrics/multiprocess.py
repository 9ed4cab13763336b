"""Metrics summed over the API processes of one server (`deepinfer serve --api-workers N`).

prometheus-client's multiprocess mode: every process writes its counters and histograms to files
in one directory, and a scrape of any process sums them. The mode is chosen when prometheus-client is
first imported, from the library's own variable `PROMETHEUS_MULTIPROC_DIR`, so `shared_metrics()` must
run before that import, and the head's children (spawned) inherit it. Worker load is not in those
files: each process reports it at scrape time from its own registry (`load_collector.py`), once per
worker, never summed. The Ray workers keep their own metrics: `hidden()` keeps the variable from the
Ray processes the head starts (each worker serves its own endpoint, and must not write here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Optional

_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def shared_metrics(enabled: bool = True) -> Iterator[Optional[str]]:
    """A fresh metrics directory for this process and those it spawns, removed at the end; None
    (nothing changes) unless `enabled`."""
    if not enabled:
        yield None
        return
    if "prometheus_client" in sys.modules:
        raise RuntimeError("shared metrics must be set up before prometheus_client is imported")
    directory = tempfile.mkdtemp(prefix="deepinfer-metrics-")
    os.environ[_ENV] = directory
    try:
        yield directory
    finally:
        os.environ.pop(_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def directory() -> Optional[str]:
    """The shared metrics directory when this process writes there (None: metrics of its own)."""
    from prometheus_client import values

    path = os.environ.get(_ENV)
    return path if path and values.ValueClass is not values.MutexValue else None


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """Processes started inside (Ray's) keep metrics of their own."""
    path = os.environ.pop(_ENV, None)
    try:
        yield
    finally:
        if path is not None:
            os.environ[_ENV] = path


def scrape_registry(path: str):
    """What /metrics serves: every process's counters and histograms, and this process's view of
    the workers' load."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from services.metrics.load_collector import load_collector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    registry.register(load_collector)
    return registry
