"""The sweep's charts (matplotlib, Agg: no display needed): latency CDFs, latency vs rate, goodput vs rate."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from services.bench.sweep.runner import ConfigSweep, SweepPlan, goodput, tail_label

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("matplotlib is not installed") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(plan: SweepPlan, sweeps: list[ConfigSweep]) -> list[str]:
    """The PNG paths written (none when no run finished)."""
    if not any(s.points for s in sweeps):
        return []
    plt = _pyplot()
    writers = {"latency_cdf.png": _cdf, "latency_vs_rate.png": _vs_rate, "goodput_vs_rate.png": _goodput}
    paths = []
    for name, draw in writers.items():
        figure = draw(plt, plan, sweeps)
        path = os.path.join(plan.output_dir, name)
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        paths.append(path)
    return paths


def per_request_ms(result: dict[str, Any]) -> dict[str, list[float]]:
    """TTFT, TPOT and E2E latency of each successful request of a result, in ms."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    tpot = [
        (result["e2els"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1) * 1e3
        for i in ok
        if result["output_lens"][i] > 1
    ]
    return {
        "TTFT": [result["ttfts"][i] * 1e3 for i in ok],
        "TPOT": tpot,
        "E2E latency": [result["e2els"][i] * 1e3 for i in ok],
    }


def _cdf(plt, plan: SweepPlan, sweeps: list[ConfigSweep]):
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for color, sweep in zip(_COLORS, sweeps):
        for k, point in enumerate(sweep.points):
            shade = 0.35 + 0.65 * (k + 1) / len(sweep.points)  # darker = higher rate
            for ax, values in zip(axes, per_request_ms(point.result).values()):
                if values:
                    xs = np.sort(values)
                    ys = np.arange(1, len(xs) + 1) / len(xs)
                    ax.step(
                        xs, ys, where="post", color=color, alpha=shade, label=f"{sweep.config.name} @ {point.rate:g}"
                    )
    for ax, name in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        slo = plan.bench.slos.get({"TTFT": "ttft", "TPOT": "tpot", "E2E latency": "e2el"}[name])
        if slo is not None:
            ax.axvline(slo, color="black", linestyle=":", linewidth=1, label="SLO")
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, title="config @ req/s", loc="lower right")
    figure.tight_layout()
    return figure


def _vs_rate(plt, plan: SweepPlan, sweeps: list[ConfigSweep]):

    tail = tail_label(plan)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, sweep in zip(_COLORS, sweeps):
        rates = [p.rate for p in sweep.points]
        for ax, metric in zip(axes, ("ttft", "tpot")):
            ax.plot(
                rates,
                [p.result[f"median_{metric}_ms"] for p in sweep.points],
                "o-",
                color=color,
                label=f"{sweep.config.name} p50",
            )
            ax.plot(
                rates,
                [p.result[f"{tail}_{metric}_ms"] for p in sweep.points],
                "s--",
                color=color,
                label=f"{sweep.config.name} {tail}",
            )
    for ax, metric in zip(axes, ("ttft", "tpot")):
        if metric in plan.bench.slos:
            ax.axhline(plan.bench.slos[metric], color="black", linestyle=":", linewidth=1, label="SLO")
        ax.set(
            title=f"{metric.upper()} vs request rate", xlabel="request rate (req/s)", ylabel=f"{metric.upper()} (ms)"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _goodput(plt, plan: SweepPlan, sweeps: list[ConfigSweep]):
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, sweep in zip(_COLORS, sweeps):
        rates = [p.rate for p in sweep.points]
        left.plot(rates, [100 * p.attainment for p in sweep.points], "o-", color=color, label=sweep.config.name)
        right.plot(
            rates, [p.result["request_goodput"] or 0 for p in sweep.points], "o-", color=color, label=sweep.config.name
        )
        best = goodput(sweep, plan.attainment)
        if best is not None:
            left.axvline(best, color=color, linestyle=":", linewidth=1)
    left.axhline(
        100 * plan.attainment, color="black", linestyle="--", linewidth=1, label=f"{plan.attainment:.0%} target"
    )
    left.set(title="SLO attainment vs rate (dotted: goodput)", xlabel="request rate (req/s)", ylabel="% of requests")
    high = max((p.rate for s in sweeps for p in s.points), default=1.0)
    right.plot([0, high], [0, high], color="gray", linewidth=0.8, label="offered rate")
    right.set(title="goodput vs rate", xlabel="request rate (req/s)", ylabel="good requests / s")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    return figure
