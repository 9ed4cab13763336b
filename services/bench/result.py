"""The result of one run: a JSON document in `vllm bench serve`'s layout, and its printed summary."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from typing import Any

from services.bench.driver import Load, RunOutcome, Target
from services.bench.metrics import Selection, compute_metrics, failure_reasons, percentile_label


def build_result(
    target: Target, load: Load, selection: Selection, slos: dict[str, float], outcome: RunOutcome, info: dict[str, Any]
) -> dict[str, Any]:
    """Run settings, then the summary metrics, then one entry per request sent in each list.

    `info`: further fields to record (dataset name, label, tokenizer, metadata).
    """
    records = outcome.records
    first = min((r.start for r in records), default=0.0)
    result: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if target.kind == "chat" else "openai",
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model_id": target.model,
        **info,
        "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "num_warmups": load.num_warmups,
        "goodput_slos_ms": slos or None,
        "aborted": outcome.aborted or None,
        **compute_metrics(records, outcome.duration, selection, slos),
        "failure_reasons": dict(failure_reasons(records)),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "e2els": [r.latency for r in records],
        "start_times": [r.start - first for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    return result


def default_filename(result: dict[str, Any]) -> str:
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(result["model_id"]).rstrip("/")))
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
    return f"{result.get('label') or 'deepinfer-bench'}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def save_result(result: dict[str, Any], result_dir: str, filename: str | None) -> str:
    os.makedirs(result_dir or ".", exist_ok=True)
    path = os.path.join(result_dir or ".", filename or default_filename(result))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return path


_LABELS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_summary(result: dict[str, Any], selection: Selection) -> str:
    """The human-readable block printed at the end of a run."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Maximum request concurrency", result["max_concurrency"] or "unlimited"),
        ("Request rate configured (RPS)", result["request_rate"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", result["request_goodput"]))
    rows += [
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Peak output token throughput (tok/s)", result["max_output_tokens_per_s"]),
        ("Peak concurrent requests", result["max_concurrent_requests"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [_row(name, value) for name, value in rows]
    for metric in selection.metrics:
        lines.append("{:-^60}".format(f" {_LABELS[metric]} "))
        keys = [f"mean_{metric}_ms", f"median_{metric}_ms"]
        keys += [f"{percentile_label(p)}_{metric}_ms" for p in selection.percentiles]
        for key in keys:
            stat = key.split("_", 1)[0]
            stat = stat.upper() if stat.startswith("p") else stat.title()
            lines.append(_row(f"{stat} {metric.upper()} (ms)", result[key]))
    lines.append("=" * 60)
    return "\n".join(lines)


def _row(name: str, value: Any) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name + ':':<44}{shown:>16}"
