"""A decode engine killed under load, with and without request migration (Dynamo's shape of run):
8 clients x N streamed requests against 1 PE + 2 CE (`deepinfer serve`), one CE killed with
SIGKILL at a fixed time; per run: requests failed, requests migrated, p50/p99 latency of the
requests before the kill and of those in flight at it or after, and the time until the decode pool
is back at its size.

    python benchmarks/fault_tolerance.py                       # 8 x 12 requests, kill at 6 s, CPU
    python benchmarks/fault_tolerance.py --requests 100 --kill-at 20 --max-tokens 128

Results: docs/benchmarks.md, "Fault tolerance".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: the repository's packages import from its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess  # noqa: E402
from tests.helpers.faults import DECODE, workers  # noqa: E402


@dataclass
class Run:
    migration_limit: int
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(start, seconds) of each request that succeeded, start relative to the run's."""
    failed: int = 0
    migrated: float = 0.0
    killed_at: float = 0.0
    healed_after: float = float("nan")


def _client(serve, run: Run, began: float, i: int, n: int, max_tokens: int) -> None:
    with httpx.Client(timeout=300) as client:
        for j in range(n):
            body = {"prompt": f"client {i} request {j}", "max_tokens": max_tokens, "stream": True}
            body.update(temperature=0, ignore_eos=True)
            start = time.monotonic()
            ok = False
            try:
                with client.stream("POST", f"{serve.base_url}/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            ok = ok or (chunk.get("choices") and chunk["choices"][0]["finish_reason"] == "length")
                            if "error" in chunk:
                                ok = False
                                break
            except httpx.HTTPError:
                ok = False
            if ok:
                run.latencies.append((start - began, time.monotonic() - start))
            else:
                run.failed += 1


def _kill_and_time_heal(serve, run: Run, began: float, kill_at: float) -> None:
    time.sleep(max(0.0, kill_at - (time.monotonic() - began)))
    victim = max(workers(serve, DECODE), key=lambda w: w.inflight)
    os.kill(victim.info.pid, signal.SIGKILL)
    run.killed_at = time.monotonic() - began
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready = [w for w in workers(serve, DECODE) if w.info.worker_id != victim.info.worker_id]
        if len(ready) == 2:
            run.healed_after = time.monotonic() - began - run.killed_at
            return
        time.sleep(0.1)


def one_run(migration_limit: int, clients: int, requests: int, max_tokens: int, kill_at: float) -> Run:
    serve = ServeProcess("--decode", "2", "--migration-limit", str(migration_limit), *SMALL_ENGINE)
    run = Run(migration_limit)
    try:
        before = serve.metric("deepinfer:migrations_total")
        began = time.monotonic()
        threads = [
            threading.Thread(target=_client, args=(serve, run, began, i, requests, max_tokens)) for i in range(clients)
        ]
        threads.append(threading.Thread(target=_kill_and_time_heal, args=(serve, run, began, kill_at)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run.migrated = serve.metric("deepinfer:migrations_total") - before
    finally:
        serve.stop()
    return run


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(runs: list[Run], clients: int, requests: int) -> str:
    rows = [
        "| migration | requests | failed | migrated | p50 / p99 before the kill (s) | "
        "p50 / p99 at or after it (s) | pool back at 2 after (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        before = [s for start, s in run.latencies if start + s < run.killed_at]
        after = [s for start, s in run.latencies if start + s >= run.killed_at]
        rows.append(
            f"| {'limit ' + str(run.migration_limit) if run.migration_limit else 'off'} | {clients * requests} | "
            f"{run.failed} | {run.migrated:.0f} | {_pct(before, 50):.2f} / {_pct(before, 99):.2f} | "
            f"{_pct(after, 50):.2f} / {_pct(after, 99):.2f} | {run.healed_after:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=12, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-at", type=float, default=6.0, help="seconds after the start")
    args = p.parse_args()
    runs = [one_run(limit, args.clients, args.requests, args.max_tokens, args.kill_at) for limit in (3, 0)]
    print(report(runs, args.clients, args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
