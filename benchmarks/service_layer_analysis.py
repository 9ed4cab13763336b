"""From what the clients received and the token sources emitted to the numbers of one level:
delivered and emitted tokens/s, per-token added latency, CPU per token, and the exactness check.

The join: a worker holds gateway request `R` as `R-0/0` (colocated; `R-0/0/<attempt>` on a
decode engine), so each delivered token j of R meets the time its step emitted it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from benchmarks.token_source import expected_tokens


def gateway_id(worker_request_id: str) -> str:
    """`<gateway id>-<prompt>/<sample>[/<attempt>]` -> `<gateway id>`."""
    return worker_request_id.split("/", 1)[0].rsplit("-", 1)[0]


@dataclass
class Emissions:
    """Emission times per gateway request id, and which worker emitted them."""

    times: dict[str, list[float]] = field(default_factory=dict)
    worker_of: dict[str, str] = field(default_factory=dict)

    def add(self, worker_id: str, log: dict[str, list[float]]) -> None:
        for key, times in log.items():
            rid = gateway_id(key)
            self.times[rid] = times
            self.worker_of[rid] = worker_id

    def count_between(self, start: float, stop: float) -> int:
        return sum(1 for times in self.times.values() for t in times if start <= t < stop)


@dataclass
class Window:
    start: float
    stop: float

    @property
    def seconds(self) -> float:
        return self.stop - self.start

    def holds(self, t: float) -> bool:
        return self.start <= t < self.stop


def verify(
    records: list[dict[str, Any]], emissions: Emissions, max_tokens: int, window: Optional[Window] = None
) -> dict[str, Any]:
    """Every delivered token must be the one the source emitted at that position, in order, none
    missing or doubled: a finished request got exactly what its source emitted (`max_tokens`
    tokens), one cut off at the end of the run a prefix of it. Mismatches break that; errors are
    requests the services failed (counted apart: the tokens they did deliver are still checked)."""
    mismatches: list[str] = []
    errors: list[str] = []
    finished = delivered = 0
    for r in records:
        tokens, rid = r["tokens"], r["request_id"] or f"slot {r['slot']}"
        delivered += len(tokens)
        emitted = emissions.times.get(r["request_id"])
        if r["error"]:
            when = r.get("error_at")
            late = f" ({when - window.stop:+.2f} s from the window's end)" if window and when else ""
            errors.append(f"{rid}: {r['error']}{late}")
        if tokens != expected_tokens([r["seed"]], len(tokens)):
            mismatches.append(f"{rid}: tokens differ from the source's sequence")
        if not r["in_order"]:
            mismatches.append(f"{rid}: a delta did not start where the previous one ended")
        if tokens and emitted is None:
            mismatches.append(f"{rid}: delivered {len(tokens)} tokens but no worker emitted it")
        elif emitted is not None and len(tokens) > len(emitted):
            mismatches.append(f"{rid}: delivered {len(tokens)} tokens, {len(emitted)} emitted")
        if r["finish_reason"] is not None:
            finished += 1
            if r["finish_reason"] != "length" or len(tokens) != max_tokens:
                mismatches.append(f"{rid}: finished ({r['finish_reason']}) with {len(tokens)} of {max_tokens} tokens")
            elif emitted is not None and len(emitted) != len(tokens):
                mismatches.append(f"{rid}: finished with {len(tokens)} tokens, {len(emitted)} emitted")
    return {
        "requests": len(records),
        "finished": finished,
        "tokens": delivered,
        "mismatches": len(mismatches),
        "errors": len(errors),
        "examples": (mismatches + errors)[:5],
    }


def latencies(records: list[dict[str, Any]], emissions: Emissions, window: Window, skip_first: bool) -> list[float]:
    """Receive minus emission time (s) of each token received inside the window; `skip_first`
    for P/D, where the first token reaches the client from the prefill engine, before the decode
    engine that logged the request has it."""
    out = []
    for r in records:
        emitted = emissions.times.get(r["request_id"])
        if emitted is None:
            continue
        for j, (got, sent) in enumerate(zip(r["recv"], emitted)):
            if window.holds(got) and not (skip_first and j == 0):
                out.append(got - sent)
    return out


def delivered_in_window(records: list[dict[str, Any]], emissions: Emissions, window: Window) -> dict[str, int]:
    """Tokens received inside the window: in all ('all') and per emitting worker."""
    counts: dict[str, int] = {"all": 0}
    for r in records:
        n = sum(1 for t in r["recv"] if window.holds(t))
        counts["all"] += n
        worker = emissions.worker_of.get(r["request_id"])
        if worker is not None:
            counts[worker] = counts.get(worker, 0) + n
    return counts


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def level_numbers(
    records: list[dict[str, Any]],
    emissions: Emissions,
    window: Window,
    cpu: dict[str, float],
    max_tokens: int,
    skip_first: bool = False,
) -> dict[str, Any]:
    """The numbers of one level. `cpu`: CPU seconds in the window per process ('head', each
    worker id, '<worker id> service' for a worker less its token source, 'clients')."""
    delivered = delivered_in_window(records, emissions, window)
    lat = latencies(records, emissions, window, skip_first)
    cpu_us = {}
    for name, seconds in cpu.items():
        owner = name.split(" ", 1)[0]  # '<worker> service' is counted against that worker's tokens
        tokens = delivered["all"] if owner in ("head", "clients") else delivered.get(owner, 0)
        cpu_us[name] = seconds * 1e6 / tokens if tokens else None
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    return {
        "delivered_tokens_per_s": delivered["all"] / window.seconds,
        "emitted_tokens_per_s": emissions.count_between(window.start, window.stop) / window.seconds,
        "latency_p50_ms": None if p50 is None else p50 * 1e3,
        "latency_p99_ms": None if p99 is None else p99 * 1e3,
        "latency_samples": len(lat),
        "cpu_us_per_token": cpu_us,
        "cpu_utilisation": {name: seconds / window.seconds for name, seconds in cpu.items()},
        "tokens_in_window": delivered,
        "check": verify(records, emissions, max_tokens, window),
    }
