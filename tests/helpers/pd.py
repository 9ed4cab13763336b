"""Shared pieces of the P/D tests: engine args, a NORMAL reference, an in-process PE."""

from __future__ import annotations

import time

from benchmarks.pd_harness import EngineProcess
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import PDConfig
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.pd.prompt_engine import PromptEngine
from deepinfer_core.roles import EngineType
from deepinfer_core.transfer.messages import KVTarget

ENGINE_ARGS = dict(device="cpu", num_gpu_blocks=192, max_model_len=256, block_size=8)


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def normal_reference(prompts: list[list[int]], params: SamplingParams, **kw) -> list[list[int]]:
    llm = LLM(**{**ENGINE_ARGS, **kw})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def local_pe(cls: type = PromptEngine, **kw) -> PromptEngine:
    """A PE in this process (for white-box checks); its transfers still cross to a CE process."""
    timeout = kw.pop("transfer_timeout_s", 10.0)
    pd = PDConfig(transfer_timeout_s=timeout, lease_grace_s=timeout + 5.0)
    args = EngineArgs(engine_type=EngineType.PROMPT, pd=pd, **{**ENGINE_ARGS, **kw})
    return cls.from_engine_args(args)


def start_ce(**kw) -> EngineProcess:
    return EngineProcess(EngineType.COMPLETION, {**ENGINE_ARGS, "stop_preempted_request": True, **kw})


def reserve(ce: EngineProcess, rid: str, prompt: list[int], params: SamplingParams, lease_s: float = 30.0) -> KVTarget:
    return KVTarget.from_bytes(ce.call("reserve", rid, params, prompt, lease_s))


def run_pe(pe: PromptEngine, max_steps: int = 1000) -> list:
    """Step the PE until idle; returns its hand-off results."""
    results = []
    for _ in range(max_steps):
        if not pe.has_unfinished_requests():
            break
        pe.step()
        results += pe.pop_handoff_results()
    return results


def wait_ce(ce: EngineProcess, ids: list[str], timeout_s: float = 120.0) -> dict:
    done = {}
    deadline = time.monotonic() + timeout_s
    while any(i not in done for i in ids):  # `done` may also hold earlier requests' leftovers
        assert time.monotonic() < deadline, f"unfinished: {[i for i in ids if i not in done]}"
        outs, _ = ce.call("collect")
        done.update({o.request_id: o for o in outs if o.finished})
        time.sleep(0.005)
    return done


def wait_free_blocks(engine: EngineProcess, expected: int, timeout_s: float = 30.0) -> int:
    """Free blocks settle after the step that releases the last finished sequences."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = engine.call("stats")["free_blocks"]
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.01)
