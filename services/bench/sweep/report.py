"""The report directory of a sweep: report.md (tables), summary.json, and the plots."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Optional

from services.bench.sweep.runner import ConfigSweep, SweepPlan, goodput, tail_label


def write_report(plan: SweepPlan, sweeps: list[ConfigSweep]) -> list[str]:
    """Write report.md, summary.json and the PNGs; the paths written."""
    from services.bench.sweep import plots

    notes: list[str] = []
    try:
        images = plots.write_plots(plan, sweeps)
    except ImportError as e:
        images = []
        notes.append(f"No plots: {e}. `pip install 'deepinfer-cluster[bench]'` brings matplotlib.")
    paths = [os.path.join(plan.output_dir, name) for name in ("report.md", "summary.json")]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(render_markdown(plan, sweeps, [os.path.basename(p) for p in images], notes))
    with open(paths[1], "w", encoding="utf-8") as f:
        json.dump(summary(plan, sweeps), f, indent=1)
    return paths + images


def _slo_text(plan: SweepPlan) -> str:
    return ", ".join(f"{name.upper()} <= {ms:g} ms" for name, ms in plan.bench.slos.items())


def render_markdown(plan: SweepPlan, sweeps: list[ConfigSweep], images: list[str], notes: list[str]) -> str:
    d = plan.bench.dataset
    count = next((p.result["num_prompts"] for s in sweeps for p in s.points), d.num_prompts)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# deepinfer bench sweep, {when}",
        "",
        f"- Dataset: {d.name}, {count} requests per run, seed {d.seed}; endpoint {plan.bench.target.endpoint}.",
        f"- SLOs: {_slo_text(plan)}. Goodput: the highest request rate at which at least "
        f"{plan.attainment:.0%} of the requests sent met every SLO (and every lower rate did too).",
        f"- Extra `deepinfer serve` flags: `{' '.join(plan.serve_args) or '(none)'}`.",
        "",
        "| configuration | serve flags | goodput (req/s) |",
        "|---|---|---:|",
    ]
    for s in sweeps:
        lines.append(f"| {s.config.name} | `{' '.join(s.config.serve_args)}` | {_goodput_text(s, plan)} |")
    tail = tail_label(plan)
    lines += [
        "",
        f"| configuration | rate (req/s) | completed | failed | TTFT p50 / {tail} (ms) | TPOT p50 / {tail} (ms) "
        f"| ITL p50 (ms) | E2E p50 (ms) | output tok/s | good req/s | SLO attainment |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sweeps:
        for p in s.points:
            lines.append(_run_row(s.config.name, p.rate, p.attainment, p.result, tail))
    lines += [""] + [f"![{name}]({name})" for name in images] + notes
    return "\n".join(lines) + "\n"


def _goodput_text(sweep: ConfigSweep, plan: SweepPlan) -> str:
    rate = goodput(sweep, plan.attainment)
    if rate is not None:
        text = f"{rate:g}"
    elif sweep.points:
        text = f"< {min(p.rate for p in sweep.points):g}"
    else:
        text = "not measured"
    return f"{text} ({sweep.error})" if sweep.error else text


def _run_row(name: str, rate: float, attainment: float, r: dict[str, Any], tail: str) -> str:
    def ms(key: str) -> str:
        value: Optional[float] = r.get(key)
        return "-" if value is None else f"{value:.1f}"

    return (
        f"| {name} | {rate:g} | {r['completed']} | {r['failed']} "
        f"| {ms('median_ttft_ms')} / {ms(f'{tail}_ttft_ms')} | {ms('median_tpot_ms')} / {ms(f'{tail}_tpot_ms')} "
        f"| {ms('median_itl_ms')} | {ms('median_e2el_ms')} | {r['output_throughput']:.1f} "
        f"| {r['request_goodput'] or 0:.2f} | {attainment:.0%} |"
    )


def summary(plan: SweepPlan, sweeps: list[ConfigSweep]) -> dict[str, Any]:
    keep = ("completed", "failed", "request_throughput", "request_goodput", "output_throughput", "aborted")
    return {
        "slos_ms": plan.bench.slos,
        "attainment_target": plan.attainment,
        "rates": plan.rates,
        "serve_args": plan.serve_args,
        "configs": [
            {
                "name": s.config.name,
                "serve_args": list(s.config.serve_args),
                "goodput": goodput(s, plan.attainment),
                "error": s.error or None,
                "runs": [
                    {
                        "rate": p.rate,
                        "slo_attainment": p.attainment,
                        **{k: p.result.get(k) for k in keep},
                        **{k: v for k, v in p.result.items() if k.endswith("_ms") and isinstance(v, float)},
                        "result_file": f"runs/{s.config.name}-rate{p.rate:g}.json",
                    }
                    for p in s.points
                ],
            }
            for s in sweeps
        ],
    }
