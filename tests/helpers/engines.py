"""Real engines on the embedded tiny model, small enough for CPU tests."""

from __future__ import annotations

from typing import Optional

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.roles import EngineType, role_profile
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence


def make_engine(engine_type: EngineType = EngineType.NORMAL, cls: type = LLMEngine, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 8)
    kw.setdefault("device", "cpu")
    if role_profile(engine_type).requires_stop_preempted_request:
        kw.setdefault("stop_preempted_request", True)
    return cls.from_engine_args(EngineArgs(engine_type=engine_type, **kw))


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns request_id -> final RequestOutput."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not go idle")


def prefill_on(pe: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
    """Run a PROMPT engine step for one request; the sequence stays in the PE with its KV."""
    seq = pe.add_request(request_id, params=params, prompt_token_ids=prompt_ids)
    while not seq.output_token_ids:
        pe.step()
    return seq


def copy_handoff(pe: LLMEngine, pe_seq: Sequence, ce: LLMEngine, params: SamplingParams) -> Sequence:
    """Hand a prefilled sequence to a CE in-process: reserve prompt + 1 blocks, copy the KV, enqueue.

    The reference for what the transfer plane does across processes.
    """
    seq = ce.add_request(pe_seq.request_id, params=params, prompt_token_ids=pe_seq.prompt_token_ids, enqueue=False)
    bm = ce.scheduler.block_manager
    seq.block_table = [bm.allocate_block() for _ in range(bm.blocks_needed(len(pe_seq)))]
    n_full = pe_seq.num_cached_tokens
    src = pe_seq.block_table[: pe.scheduler.block_manager.blocks_needed(n_full)]
    for s_blk, d_blk in zip(src, seq.block_table):
        ce.cache.kv_buffer[:, d_blk] = pe.cache.kv_buffer[:, s_blk]
    seq.num_cached_tokens = n_full
    state = ce.requests[seq.request_id]
    for tok in pe_seq.output_token_ids:
        ce._append_token(state, seq, tok, None, None)
    ce.scheduler.add_prompted(seq)
    return seq


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tiny_prompts(engine: LLMEngine, texts: Optional[list[str]] = None) -> list[list[int]]:
    texts = texts or ["Hello there", "The quick brown fox jumps over the lazy dog " * 3, "a"]
    return [engine.tokenizer.encode(t) for t in texts]
