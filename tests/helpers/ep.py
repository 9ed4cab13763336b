"""Expert-parallel instances on CPU: real processes (torch.multiprocessing spawn) joined by gloo.

    results = run_ranks(2, serve_prompts, (engine_kw, prompts_by_rank, params))   # {rank: result}

`run_ranks` starts one process per rank; each joins the instance (`join_instance`) and returns
`target(group, *args)`; a rank that raises returns its error text. Every process is reaped (and
killed past the deadline), so a hanging instance fails the test instead of the suite.
"""

from __future__ import annotations

import queue as pyqueue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.roles import EngineType

RANK_ERROR = "rank error: "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, address: str, target: Callable, args: tuple, queue, join_timeout_s: float,
               collective_timeout_s: float) -> None:  # fmt: skip
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from deepinfer_core.distributed.group import join_instance, leave_instance

    try:
        group = join_instance(rank, world, address, "gloo", join_timeout_s, collective_timeout_s)
        try:
            queue.put((rank, target(group, *args)))
        finally:
            leave_instance()
    except BaseException as e:  # reported to the test, which asserts on it
        queue.put((rank, RANK_ERROR + f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(world: int, target: Callable, args: tuple = (), timeout_s: float = 180.0, join_timeout_s: float = 180.0,
              collective_timeout_s: float = 60.0, ranks: list[int] | None = None) -> dict[int, Any]:  # fmt: skip
    """Run `target(group, *args)` on `world` ranks (or only `ranks` of them: the rest never
    join); {rank: result} of those that reported before `timeout_s`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    started = list(range(world)) if ranks is None else ranks
    procs = {
        r: ctx.Process(
            target=_rank_main,
            args=(r, world, address, target, args, queue, join_timeout_s, collective_timeout_s),
            daemon=True,
        )  # fmt: skip
        for r in started
    }
    for p in procs.values():
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        # until every rank reported, or those that did not are dead (a killed rank never reports)
        while len(results) < len(started) and time.monotonic() < deadline:
            try:
                rank, result = queue.get(timeout=0.5)
                results[rank] = result
            except pyqueue.Empty:
                if not any(p.is_alive() for r, p in procs.items() if r not in results):
                    _drain(queue, results)  # what a rank sent just before it exited
                    break
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


def _drain(queue, results: dict) -> None:
    while True:
        try:
            rank, result = queue.get(timeout=0.2)
        except pyqueue.Empty:
            return
        results[rank] = result


def make_rank_engine(group, engine_type: EngineType = EngineType.NORMAL, **kw) -> LLMEngine:
    """This rank's engine of an instance of `group.size` ranks (tiny defaults as `make_engine`)."""
    kw.setdefault("num_gpu_blocks", 128)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 8)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    if engine_type == EngineType.COMPLETION:
        kw.setdefault("stop_preempted_request", True)
    args = EngineArgs(engine_type=engine_type, expert_parallel_size=group.size, data_parallel_size=group.size,
                      data_parallel_rank=group.rank, **kw)  # fmt: skip
    return LLMEngine.from_engine_args(args, group=group)


def drive(lock, engine: LLMEngine, max_beats: int = 5000) -> dict[str, list[int]]:
    """Beat until the instance is idle; request_id -> generated token ids of this rank's requests."""
    done: dict[str, list[int]] = {}
    for _ in range(max_beats):
        for out in lock.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not lock.instance_busy:
            return done
    raise AssertionError("instance did not go idle")


def serve_prompts(group, engine_kw: dict, prompts_by_rank: dict[int, list[list[int]]], params) -> dict:
    """Each rank serves its prompts in lockstep; returns its tokens and step counters."""
    from deepinfer_core.distributed.lockstep import LockstepRank

    engine = make_rank_engine(group, **engine_kw)
    lock = LockstepRank(engine, group)
    try:
        for i, prompt in enumerate(prompts_by_rank.get(group.rank, [])):
            engine.add_request(f"r{group.rank}-{i}", params=params, prompt_token_ids=prompt)
        tokens = drive(lock, engine)
    finally:
        lock.close()
    return {"tokens": tokens, "steps": lock.num_steps, "dummy_steps": lock.num_dummy_steps}
