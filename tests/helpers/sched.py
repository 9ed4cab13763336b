"""Build real schedulers and sequences on CPU without a model (tests drive them directly)."""

from __future__ import annotations

import itertools
from typing import Optional

from deepinfer_core.config import CacheConfig, SchedulerConfig
from deepinfer_core.roles import EngineType, role_profile
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.sequence import Sequence

_ids = itertools.count()


def make_scheduler(
    engine_type: EngineType = EngineType.NORMAL,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_batched_tokens: Optional[int] = None,
    max_num_seqs: int = 16,
    chunked_prefill: bool = False,
    stop_preempted_request: Optional[bool] = None,
    prefix_caching: bool = True,
    dp_vote=None,
    num_state_slots: int = 0,
) -> Scheduler:
    if stop_preempted_request is None:
        stop_preempted_request = role_profile(engine_type).requires_stop_preempted_request
    config = SchedulerConfig(
        engine_type=engine_type,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens or max_model_len,
        max_num_seqs=max_num_seqs,
        chunked_prefill=chunked_prefill,
        stop_preempted_request=stop_preempted_request,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(config, cache, num_blocks, dp_vote, num_state_slots)


def make_seq(
    prompt_len: int = 8, max_tokens: int = 8, first_token: int = 0, request_id: Optional[str] = None, **kw
) -> Sequence:
    """A sequence whose prompt is `first_token, first_token + 1, ...` (distinct prompts share no blocks)."""
    sid = next(_ids)
    prompt = [first_token + i for i in range(prompt_len)]
    return Sequence(sid, request_id or f"req-{sid}", prompt, SamplingParams(max_tokens=max_tokens, **kw))


def complete_step(sched: Scheduler, out: SchedulerOutputs, token: int = 7) -> None:
    """What the engine does after a forward: advance the computed count, append a sample."""
    for i, seq in enumerate(out.scheduled_seqs):
        samples = out.samples(i)
        seq.num_cached_tokens += out.num_new_tokens[i]
        sched.commit_computed(seq)
        if samples:
            seq.append_token(token)
    for seq in out.finished_seqs:
        sched.free_seq(seq)


def handed_off(sched: Scheduler, prompt_len: int = 8, first_token: int = 0, max_tokens: int = 8) -> Sequence:
    """A sequence as a CE holds it after a hand-off: blocks for prompt + 1, prompt computed, first token sampled."""
    seq = make_seq(prompt_len, max_tokens, first_token)
    seq.append_token(99)
    n = sched.block_manager.blocks_needed(len(seq))
    seq.block_table = [sched.block_manager.allocate_block() for _ in range(n)]
    seq.num_cached_tokens = prompt_len
    sched.add_prompted(seq)
    return seq
