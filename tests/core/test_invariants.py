"""SPEC §5 invariants that live in one engine, each with a test that fails if it breaks."""

import time

import pytest
import torch

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.roles import EngineType
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.sequence import SequenceStatus
from tests.helpers.engines import copy_handoff, greedy, make_engine, prefill_on, run_to_completion


def test_invariant_2_a_prompt_engine_refuses_a_decode_step():
    e = make_engine(EngineType.PROMPT)
    seq = prefill_on(e, "r", [1, 2, 3], greedy(4))
    # a broken scheduler that hands the PE a decode step must be stopped before the forward
    e.scheduler.schedule = lambda: SchedulerOutputs(prompt_run=False, scheduled_seqs=[seq], num_new_tokens=[1])
    with pytest.raises(AssertionError, match="only runs prefill"):
        e.step()


class _CountFinalize(LLMEngine):
    def __init__(self, *a, **kw):
        self.finalized = []
        super().__init__(*a, **kw)

    def finalize_seq(self, seq):
        self.finalized.append(seq)
        super().finalize_seq(seq)


def test_invariant_5_prompt_engine_never_finalizes_and_keeps_blocks_until_hand_off():
    e = make_engine(EngineType.PROMPT, cls=_CountFinalize)
    free0 = e.scheduler.block_manager.num_free_blocks
    seq = prefill_on(e, "r", list(range(1, 30)), greedy(1))  # max_tokens=1: done after prefill
    assert seq.is_finished
    for _ in range(3):
        e.step()
    assert e.finalized == []
    assert seq.block_table and e.scheduler.block_manager.num_free_blocks < free0
    # the same request on a NORMAL engine is released
    n = make_engine(EngineType.NORMAL, cls=_CountFinalize)
    n.add_request("r", prompt_token_ids=list(range(1, 30)), params=greedy(1))
    run_to_completion(n)
    assert len(n.finalized) == 1 and n.scheduler.block_manager.num_free_blocks == free0


class _SlowStateCopy(LLMEngine):
    """A model with per-sequence state, a slow asynchronous state copy, and a reader in do_save_kvcache."""

    def __init__(self, *a, **kw):
        self.seen_complete = []
        super().__init__(*a, **kw)

    def _init_cache(self, dp_group):
        super()._init_cache(dp_group)
        self.cache.states = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
        self.cache.copy_states = torch.zeros(8, 4)
        self.scheduler.state_slots.__init__(8)

    def should_copy_state(self, seq):
        return True

    def _copy_state_slots(self, slots):
        time.sleep(0.2)
        super()._copy_state_slots(slots)

    def do_save_kvcache(self, scheduled, finished):
        if self.copy_state_event is not None:
            ok = self.copy_state_event.query()
            ok = ok and all(torch.equal(self.copy_state[s.state_id], self.cache.states[s.state_id]) for s in scheduled)
            self.seen_complete.append(ok)


def test_invariant_6_state_copy_is_complete_before_do_save_kvcache_reads_it():
    e = make_engine(EngineType.NORMAL, cls=_SlowStateCopy)
    e.add_request("r", prompt_token_ids=[1, 2, 3], params=greedy(3))
    run_to_completion(e)
    assert e.seen_complete and all(e.seen_complete)


def test_invariant_6_detects_a_missing_synchronisation():
    class NoSync(_SlowStateCopy):
        def pre_sampler_sync(self, out):
            event, self.copy_state_event = self.copy_state_event, None
            super().pre_sampler_sync(out)
            self.copy_state_event = event
            if not out.prompt_run and event is not None:
                self.seen_complete.append(event.query())

    e = make_engine(EngineType.NORMAL, cls=NoSync)
    e.add_request("r", prompt_token_ids=[1, 2, 3], params=greedy(3))
    run_to_completion(e)
    assert not all(e.seen_complete)  # without the synchronisation the copy is still in flight


def test_invariant_7_empty_prompt_step_is_an_empty_prefill_output():
    e = make_engine(EngineType.PROMPT)
    out = e.scheduler.schedule()
    assert out is not None and out.prompt_run and out.is_empty
    assert e.step() == []  # and the step runs (placeholder forward) without error


def test_invariant_3_completion_engine_stops_preempted_requests():
    pe = make_engine(EngineType.PROMPT)
    ce = make_engine(EngineType.COMPLETION, num_gpu_blocks=6, block_size=8)
    seqs = []
    for i in range(2):
        seq = prefill_on(pe, f"r{i}", list(range(10 * i + 1, 10 * i + 16)), greedy(40))
        seqs.append(copy_handoff(pe, seq, ce, greedy(40)))
    done = run_to_completion(ce)
    statuses = {s.status for s in seqs}
    assert SequenceStatus.FINISHED_PREEMPTED in statuses
    assert not ce.scheduler.waiting
    reasons = {o.outputs[0].finish_reason for o in done.values()}
    assert "preempted" in reasons
    assert ce.scheduler.block_manager.num_free_blocks == 6
