"""Timed engine phases: the decode batch (step times, end to end) and a single prefill."""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks.kernel_bench.engine_build import greedy_params
from benchmarks.kernel_bench.engine_spec import MIN_DECODE_STEPS, WARMUP_STEPS, Spec


@dataclass
class DecodeRun:
    e2e_s: float
    """From adding the requests until every sequence had new_tokens tokens."""
    step_s: list[float]
    """Measured decode step times (after the warm-up steps)."""
    attended: list[int]
    """Tokens each sequence attended over in each measured step."""


def run_decode(engine, prompts: list[list[int]], spec: Spec) -> tuple[DecodeRun, list[str]]:
    """Add the batch, step until the e2e point and enough measured decode steps; the requests stay
    in the engine (still decoding) for the profiler and the routing count. Returns their ids too."""
    max_tokens = spec.decode_max_tokens
    ids = [f"decode-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, params=greedy_params(max_tokens))
    e2e, prev_t, prev_lo, decode_steps = None, t0, 0, 0
    step_s: list[float] = []
    attended: list[int] = []
    steps_left = 4 * (max_tokens + len(prompts)) + 50  # bounded: a stuck engine fails, it does not hang
    while e2e is None or len(step_s) < MIN_DECODE_STEPS:
        steps_left -= 1
        if steps_left < 0 or not engine.has_unfinished_requests():
            raise RuntimeError(f"the decode batch stopped short: {min(counts.values())} tokens per sequence")
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
        lo, hi = min(counts.values()), max(counts.values())
        if lo >= max_tokens:
            raise RuntimeError("the decode batch ran out of tokens before the measurement finished")
        if e2e is None and lo >= spec.new_tokens:
            e2e = now - t0
        if prev_lo >= 1 and lo == prev_lo + 1 and hi == lo:  # one token for every sequence: a decode step
            decode_steps += 1
            if decode_steps > WARMUP_STEPS:
                step_s.append(now - prev_t)
                attended.append(len(prompts[0]) + prev_lo)
        prev_t, prev_lo = now, lo
    return DecodeRun(e2e, step_s, attended), ids


def finish(engine, ids: list[str]) -> None:
    """Abort the decode batch and step until the engine has released it."""
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def run_prefill(engine, prompt: list[int], reps: int) -> list[float]:
    """Seconds from adding one prompt (max_tokens=1) to its finished output, `reps` times after a warm-up."""
    times = []
    for r in range(reps + 1):
        rid = f"prefill-{r}"
        t = time.perf_counter()
        engine.add_request(rid, prompt_token_ids=prompt, params=greedy_params(1))
        done, steps = False, 0
        while not done:
            if not engine.has_unfinished_requests() or steps > 50:
                raise RuntimeError("the prefill request did not finish")
            done = any(o.request_id == rid and o.finished for o in engine.step())
            steps += 1
        dt = time.perf_counter() - t
        while engine.has_unfinished_requests():  # release its blocks, untimed
            engine.step()
        if r:
            times.append(dt)
    return times
