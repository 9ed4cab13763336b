"""Running a sweep: each configuration started in turn, the same requests at each rate."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from services.bench.metrics import percentile_label, slo_attainment
from services.bench.models import first_model
from services.bench.records import BenchRequest
from services.bench.result import save_result
from services.bench.serve import ServeBench, make_requests, measure
from services.bench.sweep.configs import ServeConfig
from services.bench.sweep.launcher import LaunchedServer, ServerFailed

INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class SweepPlan:
    configs: list[ServeConfig]
    rates: list[float]
    """Request rates (req/s), ascending."""
    bench: ServeBench
    """What each run sends; its target's URL and model are filled in from each started server."""
    output_dir: str
    serve_args: list[str] = field(default_factory=list)
    """Passed to every `deepinfer serve` after the configuration's own flags."""
    attainment: float = 0.9
    """Goodput is the highest rate at which at least this fraction of requests meets every SLO."""
    search_steps: int = 0
    """Bisections between the goodput rate of the grid and the next rate, to place it closer."""
    serve_timeout_s: float = 600.0


@dataclass
class SweepPoint:
    rate: float
    attainment: float
    """Fraction of the requests sent that met every SLO."""
    result: dict[str, Any]
    """The run's result, as `bench serve` saves it."""


@dataclass
class ConfigSweep:
    config: ServeConfig
    points: list[SweepPoint] = field(default_factory=list)
    error: str = ""
    """Why the configuration did not finish ("" when it did)."""

    def passes(self, point: SweepPoint, target: float) -> bool:
        return point.attainment >= target and not point.result.get("aborted")


def goodput(sweep: ConfigSweep, target: float) -> Optional[float]:
    """The highest rate such that it and every lower rate measured met the attainment target."""
    best = None
    for point in sorted(sweep.points, key=lambda p: p.rate):
        if not sweep.passes(point, target):
            break
        best = point.rate
    return best


def run_sweep(plan: SweepPlan) -> list[ConfigSweep]:
    """Every configuration over every rate; a configuration that fails is recorded and skipped."""
    os.makedirs(os.path.join(plan.output_dir, "runs"), exist_ok=True)
    requests = make_requests(plan.bench)
    sweeps = []
    for config in plan.configs:
        sweep = ConfigSweep(config)
        sweeps.append(sweep)
        try:
            _sweep_config(plan, sweep, requests)
        except ServerFailed as e:
            sweep.error = f"deepinfer serve {' '.join(config.serve_args)}: {e}"
            print(f"[{config.name}] {sweep.error}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            sweep.error = INTERRUPTED
            break
    return sweeps


def _sweep_config(plan: SweepPlan, sweep: ConfigSweep, requests: list[BenchRequest]) -> None:
    log_path = os.path.join(plan.output_dir, f"{sweep.config.name}.serve.log")
    print(f"[{sweep.config.name}] starting deepinfer serve {' '.join(sweep.config.serve_args)} ...", flush=True)
    server = LaunchedServer(sweep.config, plan.serve_args, log_path)
    try:
        url = server.wait_ready(plan.serve_timeout_s)
        bench = dataclasses.replace(plan.bench, target=dataclasses.replace(plan.bench.target, base_url=url))
        if not bench.target.model:
            bench = dataclasses.replace(bench, target=dataclasses.replace(bench.target, model=_model_of(url)))
        for rate in plan.rates:
            _measure_point(plan, sweep, bench, requests, rate)
        _refine(plan, sweep, bench, requests)
    finally:
        server.stop()


def _refine(plan: SweepPlan, sweep: ConfigSweep, bench: ServeBench, requests: list[BenchRequest]) -> None:
    """Bisect between the grid's goodput rate and the first rate above it that failed."""
    for _ in range(plan.search_steps):
        low = goodput(sweep, plan.attainment)
        above = [p.rate for p in sweep.points if low is not None and p.rate > low]
        if low is None or not above:
            return
        _measure_point(plan, sweep, bench, requests, (low + min(above)) / 2)


def _measure_point(plan: SweepPlan, sweep: ConfigSweep, bench: ServeBench, requests, rate: float) -> None:
    bench = dataclasses.replace(bench, load=dataclasses.replace(bench.load, request_rate=rate))
    bench = dataclasses.replace(bench, label=sweep.config.name)
    result, outcome = asyncio.run(measure(bench, requests))
    result["serve_args"] = [*sweep.config.serve_args, *plan.serve_args]
    save_result(result, os.path.join(plan.output_dir, "runs"), f"{sweep.config.name}-rate{rate:g}.json")
    point = SweepPoint(rate, slo_attainment(outcome.records, bench.slos, len(requests)), result)
    sweep.points.append(point)
    sweep.points.sort(key=lambda p: p.rate)
    print(f"[{sweep.config.name}] rate {rate:g} req/s: {_describe(point)}", flush=True)
    if outcome.aborted:
        print(f"[{sweep.config.name}] {outcome.aborted}", file=sys.stderr, flush=True)


def _describe(point: SweepPoint) -> str:
    r = point.result
    return (
        f"{r['completed']} ok, {r['failed']} failed, TTFT p50 {r.get('median_ttft_ms', 0):.1f} ms, "
        f"TPOT p50 {r.get('median_tpot_ms', 0):.2f} ms, SLO attainment {point.attainment:.0%}"
    )


def _model_of(url: str) -> str:
    try:
        return first_model(url)
    except ValueError as e:
        raise ServerFailed(str(e)) from None


def tail_label(plan: SweepPlan) -> str:
    """The highest percentile the runs report, e.g. "p99": the tables' tail column."""
    return percentile_label(max(plan.bench.selection.percentiles))
