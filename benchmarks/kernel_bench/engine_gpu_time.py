"""GPU time around decode steps: idle time from a profiler trace, and the gap between steps from
CUDA events on the engine's stream."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any, Optional

import torch

from benchmarks.kernel_bench.engine_spec import PROFILER_WARMUP


def merge_busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(span, busy) of [start, end) intervals: busy = length of their union."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (cur_s, cur_e) = 0.0, intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return max(e for _, e in intervals) - intervals[0][0], busy


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(trace_events: list[dict]) -> list[tuple[float, float]]:
    """[start, end) in µs of every kernel / memcpy / memset of a chrome trace."""
    out = []
    for e in trace_events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_EVENT_CATEGORIES:
            start = float(e["ts"])
            out.append((start, start + float(e.get("dur", 0.0))))
    return out


def measure_idle(engine, steps: int, activities: Optional[list] = None) -> dict[str, Any]:
    """GPU idle per decode step over `steps` profiled steps (see the module docstring).
    `activities`: the profiler's (default CUDA alone; a test passes CPU)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        plan = schedule(wait=0, warmup=PROFILER_WARMUP, active=steps, repeat=1)
        with profile(activities=activities or [ProfilerActivity.CUDA], schedule=plan,
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:  # fmt: skip
            for _ in range(PROFILER_WARMUP + steps):
                engine.step()
                prof.step()
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    intervals = gpu_intervals(events)
    span, busy = merge_busy(intervals)
    if not intervals or span <= 0:
        return {"idle_us_per_step": None, "busy_frac": None, "kernels": 0, "profiled_steps": steps}
    return {
        "idle_us_per_step": (span - busy) / steps,
        "busy_frac": busy / span,
        "span_ms": span / 1e3,
        "kernels": len(intervals),
        "profiled_steps": steps,
    }


def measure_gaps(engine, steps: int) -> dict[str, Any]:
    """Per decode step, from CUDA events on the engine's stream (no profiler): `gpu_ms`, from the
    start of a step's launch to the end of its queued sampling as the stream executes them, and
    `gap_us`, the stream's time between the end of one step and the start of the next: ~0 when
    the next step was queued before this one finished (the host's work was hidden), the host's
    unhidden work otherwise. Medians over `steps` steps."""
    runner = engine.worker.runner
    launch = runner.launch
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        handle = launch(*args, **kwargs)
        end.record()
        marks.append((start, end))
        return handle

    runner.launch = timed
    try:
        for _ in range(steps + 1):
            engine.step()
    finally:
        runner.launch = launch
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) for s, e in marks]
    gaps = [prev_end.elapsed_time(start) * 1e3 for (_, prev_end), (start, _) in zip(marks, marks[1:])]
    return {"gpu_ms_per_step": statistics.median(gpu), "gap_us_per_step": statistics.median(gaps)}
