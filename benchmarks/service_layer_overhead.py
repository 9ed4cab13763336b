"""Per-request overhead: one non-streamed completion at a time through gateway -> router ->
worker, against the same token source driven in this process with no services in between.

Both run the token source at the same step period (0 by default: steps back to back, so the
difference is the service layer's work and waits, not the engine's clock). The CPU the head and
the workers spend per request over the served run is reported beside the wall-clock numbers.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from benchmarks.service_layer_client import prompt_of
from benchmarks.service_layer_cluster import Cluster, fold_api_processes
from benchmarks.service_layer_procs import cpu_delta, cpu_times
from benchmarks.service_layer_sse import HttpConnection
from benchmarks.token_source import WORDS, TokenSourceEngine, expected_tokens, token_source_config
from deepinfer_core.sampling_params import SamplingParams


async def _served(url: str, prompt: list[int], max_tokens: int, repeats: int) -> tuple[list[float], list[str]]:
    conn = HttpConnection(url)
    body = {"prompt": prompt, "max_tokens": max_tokens}
    try:
        await conn.post_json("/v1/completions", body)  # warm the path and the connection
        times, texts = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            answer = await conn.post_json("/v1/completions", body)
            times.append(time.perf_counter() - t)
            texts.append(answer["choices"][0]["text"])
        return times, texts
    finally:
        conn.close()


def _local(prompt: list[int], max_tokens: int, repeats: int, step_period_s: float) -> list[float]:
    engine = TokenSourceEngine(token_source_config(), step_period_s=step_period_s, record_emissions=False)
    params = SamplingParams(max_tokens=max_tokens)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        engine.add_request(f"local-{i}", params=params, prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first warms up


def measure_overhead(
    cluster: Cluster, max_tokens: int, prompt_len: int, repeats: int, step_period_s: float
) -> dict[str, Any]:
    prompt = prompt_of(7, prompt_len)
    cluster.configure(step_period_s)
    pids = cluster.pids()
    try:
        before = {name: cpu_times(pid) for name, pid in pids.items()}
        served, texts = asyncio.run(_served(cluster.http_url, prompt, max_tokens, repeats))
        after = {name: cpu_times(pid) for name, pid in pids.items()}
    finally:
        cluster.configure(cluster.options.step_ms / 1e3)
    expected = "".join(WORDS[t] for t in expected_tokens(prompt, max_tokens))
    local = _local(prompt, max_tokens, repeats, step_period_s)
    served_s, local_s = statistics.median(served), statistics.median(local)
    spent = fold_api_processes({n: cpu_delta(before[n], after[n]) for n in pids})
    worker_cpu = sum(v for n, v in spent.items() if n != "head")
    return {
        "requests": repeats,
        "output_tokens": max_tokens,
        "step_period_ms": step_period_s * 1e3,
        "served_ms": served_s * 1e3,
        "in_process_ms": local_s * 1e3,
        "overhead_ms_per_request": (served_s - local_s) * 1e3,
        "overhead_us_per_output_token": (served_s - local_s) * 1e6 / max_tokens,
        "ratio": served_s / local_s if local_s > 0 else None,
        "head_cpu_ms_per_request": spent["head"] * 1e3 / (repeats + 1),
        "workers_cpu_ms_per_request": worker_cpu * 1e3 / (repeats + 1),
        "text_exact": all(t == expected for t in texts),
    }
