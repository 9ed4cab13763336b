"""From request records to the numbers of a result: latency statistics, throughput, goodput.

Names and units follow `vllm bench serve`: latencies in milliseconds as `{mean,median,std,pN}_{metric}_ms`,
statistics over the successful requests only, 0 where no request gave a value. TPOT counts only
requests with two or more output tokens; ITL pools every gap between tokens after the first, so
the time to the first token is in TTFT and never in ITL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.bench.records import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
"""ttft: time to first token; tpot: time per output token after the first; itl: inter-token latency;
e2el: end-to-end latency."""

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_slos(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput {item!r}: expected NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A successful request that meets every SLO given. With one output token TPOT is not defined,
    so a TPOT SLO does not fail it."""
    if not record.success:
        return False
    tpot = record.tpot
    measured = {"ttft": record.ttft, "tpot": 0.0 if tpot is None else tpot, "e2el": record.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos.items())


def slo_attainment(records: list[RequestRecord], slos: dict[str, float], num_sent: int) -> float:
    """Fraction of the requests sent (failures included) that met every SLO."""
    return sum(meets_slos(r, slos) for r in records) / num_sent if num_sent else 0.0


@dataclass(frozen=True)
class Selection:
    """Which statistics a result carries."""

    metrics: tuple[str, ...] = METRICS
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)


def parse_selection(metrics: str, percentiles: str) -> Selection:
    """--percentile-metrics "ttft,tpot,itl" and --metric-percentiles "50,90,99"."""
    names = tuple(m.strip() for m in metrics.split(",") if m.strip())
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics: unknown {unknown or metrics!r}; choose from {', '.join(METRICS)}")
    try:
        values = tuple(float(p) for p in percentiles.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles {percentiles!r}: expected numbers such as 50,90,99") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {percentiles!r}: each must be in (0, 100]")
    return Selection(names, values)


def percentile_label(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean, median, std and the percentiles of `seconds`, in ms, keyed as `mean_{name}_ms`..."""
    ms = np.asarray(seconds, dtype=float) * 1000.0
    empty = ms.size == 0
    stats = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(ms)),
    }
    for p in percentiles:
        stats[f"{percentile_label(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return stats


def metric_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric, over the successful requests."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def max_concurrent(records: list[RequestRecord]) -> int:
    """The most requests in flight at one instant."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def peak_output_rate(records: list[RequestRecord], start: float) -> float:
    """Most output tokens in one second of the run (tokens are placed at their chunks' arrival)."""
    per_second: Counter[int] = Counter()
    for r in records:
        if not r.success:
            continue
        times = np.cumsum([r.start + r.ttft, *r.itl])
        # With usage counts a chunk may hold several tokens: spread them over the chunks evenly.
        share = r.output_tokens / len(times)
        for t in times:
            per_second[int(t - start)] += share
    return float(max(per_second.values(), default=0.0))


def compute_metrics(
    records: list[RequestRecord], duration: float, selection: Selection, slos: dict[str, float]
) -> dict[str, Any]:
    """The summary fields of a result, named as `vllm bench serve` names them."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(meets_slos(r, slos) for r in ok)) if slos else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_output_rate(records, min((r.start for r in records), default=0.0)),
        "max_concurrent_requests": max_concurrent(records),
    }
    values = metric_values(records)
    for name in selection.metrics:
        result.update(latency_stats(name, values[name], selection.percentiles))
    return result


def failure_reasons(records: list[RequestRecord]) -> list[tuple[str, int]]:
    """Distinct errors, most frequent first."""
    return Counter(r.error for r in records if not r.success).most_common()
