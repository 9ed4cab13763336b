"""The process harness of the floor benchmarks (`grpc_server_floor.py`, `sse_floor.py`): one server
process and client processes of their own, the server's CPU time measured from /proc while the
clients run."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.service_layer_procs import cpu_delta, cpu_times


@dataclass
class FloorRun:
    results: list
    """One item a client process put, in the order they came."""
    server_cpu_s: float
    seconds: float


def run_floor(
    server_main: Callable,
    server_args: tuple,
    client_main: Callable,
    client_args: tuple,
    streams: int,
    clients: int,
    result_timeout_s: float,
) -> FloorRun:
    """`server_main(*server_args, ready, port, stop)` in a process: it sets `port.value` and `ready`
    once it serves, and stops when `stop` is set. Then `clients` processes of
    `client_main(port, n, *client_args, go, results)`, the `streams` shared among them; each waits
    for `go` and puts one result on `results`. The server's CPU counts from `go` to the last result."""
    ctx = mp.get_context("spawn")
    ready, stop, go = ctx.Event(), ctx.Event(), ctx.Event()
    port, results = ctx.Value("i", 0), ctx.Queue()
    server = ctx.Process(target=server_main, args=(*server_args, ready, port, stop), daemon=True)
    server.start()
    if not ready.wait(60):
        raise RuntimeError("the server did not start")
    per = [streams // clients + (i < streams % clients) for i in range(clients)]
    procs = [ctx.Process(target=client_main, args=(port.value, n, *client_args, go, results), daemon=True) for n in per]
    for p in procs:
        p.start()
    time.sleep(2.0)  # the clients' imports and connections
    cpu0, t0 = cpu_times(server.pid), time.monotonic()
    go.set()
    done = [results.get(timeout=result_timeout_s) for _ in procs]
    cpu1, t1 = cpu_times(server.pid), time.monotonic()
    stop.set()
    server.join(10)
    for p in procs:
        p.join(10)
    return FloorRun(done, cpu_delta(cpu0, cpu1), t1 - t0)
