"""The service-layer benchmark's tables: one row per (protocol, streams) level, the per-request
overhead, and the ratios against the targets (head <= 20 µs and a worker's service layer <= 10 µs
of CPU per streamed token)."""

from __future__ import annotations

from typing import Any, Optional

HEAD_TARGET_US = 20.0
WORKER_TARGET_US = 10.0
SATURATED = 0.9
"""A level delivering under this fraction of what its streams ask for (streams x tokens per step
/ step period) is saturated: the sources hold fewer streams than the clients keep open (a stream's
tokens were all emitted and wait in the services' queues), and latency is queueing."""


def _f(value: Optional[float], fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _workers(level: dict[str, Any]) -> list[str]:
    """Streaming workers (those with tokens of their own)."""
    cpu = level["cpu_us_per_token"]
    return sorted(k for k in cpu if k not in ("head", "clients") and " " not in k and cpu[k] is not None)


def saturated(level: dict[str, Any]) -> bool:
    offered = level["offered_tokens_per_s"]
    return bool(offered) and level["delivered_tokens_per_s"] < SATURATED * offered


def level_table(levels: list[dict[str, Any]]) -> list[str]:
    workers = _workers(levels[0]) if levels else []
    head = "| protocol | streams | offered / emitted / delivered tok/s | tok/step | added latency p50 / p99 (ms) "
    head += "| head µs/tok | head CPU |"
    head += "".join(f" {w} µs/tok: process / service |" for w in workers) + " clients µs/tok | check |"
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(workers) + "---:|---|"]
    for lv in levels:
        cpu, util = lv["cpu_us_per_token"], lv["cpu_utilisation"]
        check = lv["check"]
        verdict = "exact" if check["mismatches"] == 0 else f"{check['mismatches']} MISMATCHES"
        verdict += f", {check['errors']} failed" if check["errors"] else ""
        latency = f"{_f(lv['latency_p50_ms'])} / {_f(lv['latency_p99_ms'])}" + (" (sat.)" if saturated(lv) else "")
        rates = f"{_f(lv['offered_tokens_per_s'], '.0f')} / {lv['emitted_tokens_per_s']:.0f} / "
        rates += f"{lv['delivered_tokens_per_s']:.0f}"
        row = f"| {lv['protocol']} | {lv['streams']} | {rates} | {_f(lv['engine_batch'])} | {latency} | "
        row += f"{_f(cpu['head'])} | {util['head']:.0%} |"
        row += "".join(f" {_f(cpu.get(w))} / {_f(cpu.get(f'{w} service'))} |" for w in workers)
        row += f" {_f(cpu['clients'])} | {verdict} ({check['requests']} req, {check['finished']} done) |"
        rows.append(row)
    return rows


def problem_lines(levels: list[dict[str, Any]]) -> list[str]:
    """The first few mismatches and failed requests of each level that had any."""
    lines = []
    for lv in levels:
        for example in lv["check"]["examples"]:
            lines.append(f"  {lv['protocol']} {lv['streams']} streams: {example}")
    return lines


def idle_line(idle: dict[str, float]) -> str:
    parts = ", ".join(f"{name} {share:.1%}" for name, share in idle.items())
    return f"Idle CPU (share of one core, no requests): {parts}"


def overhead_table(o: dict[str, Any]) -> list[str]:
    return [
        f"Per-request overhead: {o['requests']} non-streamed requests of {o['output_tokens']} tokens, one at a "
        f"time, token source step period {o['step_period_ms']:g} ms",
        "| through the services (ms) | in-process (ms) | overhead / request (ms) | overhead / output token (µs) "
        "| ratio | head CPU / request (ms) | workers CPU / request (ms) | text |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {o['served_ms']:.2f} | {o['in_process_ms']:.3f} | {o['overhead_ms_per_request']:.2f} | "
        f"{o['overhead_us_per_output_token']:.0f} | {_f(o['ratio'], '.0f')} | {o['head_cpu_ms_per_request']:.2f} | "
        f"{o['workers_cpu_ms_per_request']:.2f} | {'exact' if o['text_exact'] else 'WRONG'} |",
    ]


def ratios(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Head and worker CPU per token at the most streams, against the targets, per protocol."""
    out: dict[str, Any] = {}
    for protocol in dict.fromkeys(lv["protocol"] for lv in levels):
        top = max((lv for lv in levels if lv["protocol"] == protocol), key=lambda lv: lv["streams"])
        cpu = top["cpu_us_per_token"]
        worst = max((cpu[f"{w} service"] for w in _workers(top) if cpu[f"{w} service"] is not None), default=None)
        out[protocol] = {
            "streams": top["streams"],
            "head_over_target": None if cpu["head"] is None else cpu["head"] / HEAD_TARGET_US,
            "worker_over_target": None if worst is None else worst / WORKER_TARGET_US,
        }
    by_proto = {lv["protocol"]: lv for lv in levels if lv["streams"] == max(x["streams"] for x in levels)}
    if "sse" in by_proto and "grpc" in by_proto:
        sse, grpc = by_proto["sse"]["cpu_us_per_token"]["head"], by_proto["grpc"]["cpu_us_per_token"]["head"]
        out["head_sse_over_grpc"] = sse / grpc if sse and grpc else None
    return out


def ratio_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for protocol, v in r.items():
        if isinstance(v, dict):
            lines.append(
                f"{protocol} at {v['streams']} streams: head CPU per token {_f(v['head_over_target'])}x the "
                f"{HEAD_TARGET_US:g} µs target; busiest worker {_f(v['worker_over_target'])}x the "
                f"{WORKER_TARGET_US:g} µs target (its service layer: the process less the token source)"
            )
    if r.get("head_sse_over_grpc") is not None:
        lines.append(f"head CPU per SSE token / per gRPC token: {r['head_sse_over_grpc']:.2f}")
    return lines
