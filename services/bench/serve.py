"""`deepinfer bench serve`: one load against one endpoint, from the dataset to the saved result."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from services.bench.datasets import DatasetOptions, load_dataset
from services.bench.driver import Load, RunOutcome, Target, run_load
from services.bench.metrics import Selection, failure_reasons
from services.bench.models import list_models
from services.bench.records import BenchRequest
from services.bench.result import build_result, format_summary, save_result
from services.bench.tokens import TokenSource, load_tokenizer

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


@dataclass(frozen=True)
class ServeBench:
    """Everything one `bench serve` run needs."""

    target: Target
    dataset: DatasetOptions
    load: Load = field(default_factory=Load)
    selection: Selection = field(default_factory=Selection)
    slos: dict[str, float] = field(default_factory=dict)
    """--goodput: milliseconds per metric (ttft, tpot, e2el)."""
    tokenizer: Optional[str] = None
    label: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    save: bool = False
    result_dir: str = "."
    result_filename: Optional[str] = None


def make_requests(bench: ServeBench) -> list[BenchRequest]:
    tokens = TokenSource(load_tokenizer(bench.tokenizer, bench.target.model))
    return load_dataset(bench.dataset, tokens)


async def measure(
    bench: ServeBench, requests: list[BenchRequest], stop: Optional[asyncio.Event] = None
) -> tuple[dict[str, Any], RunOutcome]:
    """Run the load and build its result (not saved, not printed)."""
    outcome = await run_load(bench.target, requests, bench.load, stop)
    if "HTTP 404" in outcome.aborted:
        outcome.aborted += _models_hint(bench.target)
    info = {
        "label": bench.label,
        "dataset_name": bench.dataset.name,
        "dataset_path": bench.dataset.path,
        "tokenizer_id": bench.tokenizer,
        "num_prompts": len(requests),
        **bench.metadata,
    }
    return build_result(bench.target, bench.load, bench.selection, bench.slos, outcome, info), outcome


def _models_hint(target: Target) -> str:
    """The model ids the server lists, to put beside a 404 (nothing when it lists none)."""
    try:
        ids = list_models(target.base_url, target.api_key)
    except ValueError:
        return ""
    return f" (--model {target.model!r}; the server lists: {', '.join(ids)})" if ids else ""


def run(bench: ServeBench) -> int:
    """The command: print the summary, save the result when asked, return the exit status."""
    requests = make_requests(bench)
    print(f"deepinfer bench: {len(requests)} requests ({bench.dataset.name}) to {bench.target.url}", flush=True)
    return asyncio.run(_run(bench, requests))


async def _run(bench: ServeBench, requests: list[BenchRequest]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)  # Ctrl-C: keep what finished, save, exit 130
    try:
        result, outcome = await measure(bench, requests, stop)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if outcome.records:
        print(format_summary(result, bench.selection))
    if bench.save or bench.result_filename:
        print(f"deepinfer bench: result saved to {save_result(result, bench.result_dir, bench.result_filename)}")
    return report_status(outcome, stop.is_set())


def report_status(outcome: RunOutcome, interrupted: bool) -> int:
    """Say on stderr what went wrong, if anything; the exit status."""
    if outcome.aborted and not outcome.records:
        print(f"deepinfer bench: error: {outcome.aborted}", file=sys.stderr)
        return EXIT_FAILED
    failed = [r for r in outcome.records if not r.success]
    if failed:
        reasons = "; ".join(f"{count} x {error}" for error, count in failure_reasons(outcome.records)[:5])
        print(
            f"deepinfer bench: error: {len(failed)} of {len(outcome.records)} requests failed: {reasons}",
            file=sys.stderr,
        )
    if interrupted:
        print(f"deepinfer bench: interrupted after {len(outcome.records)} requests", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failed else EXIT_OK
