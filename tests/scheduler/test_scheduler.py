"""The real scheduler and block manager driven directly on CPU (SPEC §3)."""

import pytest

from deepinfer_core.roles import EngineType
from deepinfer_core.sequence import SequenceStatus
from tests.helpers.sched import complete_step, handed_off, make_scheduler, make_seq


def test_prefill_then_decode_moves_through_queues():
    s = make_scheduler()
    seq = make_seq(prompt_len=10, max_tokens=4)
    s.add_sequence(seq)
    out = s.schedule()
    assert out.prompt_run and out.scheduled_seqs == [seq] and out.num_new_tokens == [10]
    assert seq in s.running and not s.waiting
    complete_step(s, out)
    assert seq.num_cached_tokens == 10 and len(seq) == 11
    out = s.schedule()
    assert not out.prompt_run and out.scheduled_seqs == [seq] and out.num_new_tokens == [1]


def test_token_budget_and_max_num_seqs_limit_a_prefill_step():
    s = make_scheduler(max_model_len=32, max_num_batched_tokens=32, max_num_seqs=3)
    seqs = [make_seq(prompt_len=12, first_token=100 * i) for i in range(5)]
    for q in seqs:
        s.add_sequence(q)
    out = s.schedule()
    assert out.scheduled_seqs == seqs[:2]  # 12 + 12 fit, 36 would not
    complete_step(s, out)
    out = s.schedule()
    assert out.scheduled_seqs == seqs[2:3]  # max_num_seqs=3 counts running ones
    assert out.prompt_run


def test_normal_empty_prefill_falls_through_to_decode():
    s = make_scheduler(EngineType.NORMAL)
    assert s._schedule_prefill() is None
    seq = make_seq()
    s.add_sequence(seq)
    complete_step(s, s.schedule())
    out = s.schedule()
    assert out.prompt_run is False and out.scheduled_seqs == [seq]


def test_prompt_empty_schedule_is_an_empty_prefill_output():  # invariant 7
    s = make_scheduler(EngineType.PROMPT)
    out = s.schedule()
    assert out is not None and out.prompt_run is True and out.is_empty


def test_prompt_never_decodes_even_with_running_sequences():  # invariant 2 at the scheduler
    s = make_scheduler(EngineType.PROMPT)
    seq = make_seq()
    s.add_sequence(seq)
    complete_step(s, s.schedule())
    for _ in range(3):
        out = s.schedule()
        assert out.prompt_run and out.is_empty


def test_completion_decodes_handed_off_sequences_and_prefills_only_its_local_prompts():
    s = make_scheduler(EngineType.COMPLETION)
    seq = handed_off(s)
    out = s.schedule()
    assert not out.prompt_run and out.scheduled_seqs == [seq]
    complete_step(s, out)
    local = make_seq(prompt_len=6, first_token=500)  # conditional disaggregation: the only way into a CE's waiting
    s.add_sequence(local)
    out = s.schedule()
    assert out.prompt_run and out.scheduled_seqs == [local] and out.num_new_tokens == [6]
    complete_step(s, out)
    out = s.schedule()
    assert not out.prompt_run and set(out.scheduled_seqs) == {seq, local}


def test_completion_local_prefills_stay_within_its_decode_bound():
    # a CE's forward bound is max_num_seqs * (1 + nextn) tokens, however large the step budget
    s = make_scheduler(EngineType.COMPLETION, max_num_seqs=8, max_model_len=64)
    assert s.config.max_step_tokens == 8
    seqs = [make_seq(prompt_len=5, first_token=100 * i) for i in range(2)]
    for q in seqs:
        s.add_sequence(q)
    out = s.schedule()
    assert out.prompt_run and out.scheduled_seqs == seqs[:1]  # 5 + 5 > 8
    complete_step(s, out)
    out = s.schedule()
    assert out.prompt_run and out.scheduled_seqs == seqs[1:]


def test_unknown_role_fails_loudly():
    s = make_scheduler()
    s.engine_type = "bogus"
    with pytest.raises(RuntimeError, match="unknown engine_type"):
        s.schedule()


def test_chunked_prefill_normal_stops_after_first_chunked_request():
    s = make_scheduler(EngineType.NORMAL, max_model_len=64, max_num_batched_tokens=16, chunked_prefill=True)
    long, short = make_seq(prompt_len=40), make_seq(prompt_len=4, first_token=500)
    s.add_sequence(long)
    s.add_sequence(short)
    out = s.schedule()
    assert out.scheduled_seqs == [long] and out.num_new_tokens == [16]
    assert long in s.waiting and long not in s.running  # prompt incomplete: stays at the head
    complete_step(s, out)
    out = s.schedule()
    assert out.scheduled_seqs == [long] and out.num_new_tokens == [16]
    complete_step(s, out)
    out = s.schedule()
    assert out.scheduled_seqs == [long, short] and out.num_new_tokens == [8, 4]
    assert out.samples(0) and out.samples(1)


def test_chunked_prefill_prompt_keeps_filling_the_budget():
    s = make_scheduler(EngineType.PROMPT, max_model_len=64, max_num_batched_tokens=16, chunked_prefill=True)
    a, b, c = make_seq(prompt_len=6), make_seq(prompt_len=20, first_token=100), make_seq(prompt_len=3, first_token=200)
    for q in (a, b, c):
        s.add_sequence(q)
    out = s.schedule()
    assert out.scheduled_seqs == [a, b] and out.num_new_tokens == [6, 10]
    assert out.num_batched_tokens == 16


def test_normal_chunk_of_one_request_with_budget_left_still_stops():
    # NORMAL stops picking after a chunked request even when that request was not the first.
    s = make_scheduler(EngineType.NORMAL, max_model_len=64, max_num_batched_tokens=16, chunked_prefill=True)
    a, b, c = make_seq(prompt_len=6), make_seq(prompt_len=20, first_token=100), make_seq(prompt_len=3, first_token=200)
    for q in (a, b, c):
        s.add_sequence(q)
    out = s.schedule()
    assert out.scheduled_seqs == [a, b] and c in s.waiting


def test_without_chunking_a_prompt_over_budget_is_refused_by_config():
    with pytest.raises(ValueError, match="chunked_prefill"):
        make_scheduler(max_model_len=64, max_num_batched_tokens=16, chunked_prefill=False)


def test_prefix_cache_hits_full_blocks_and_leaves_the_last_token_to_compute():
    s = make_scheduler(block_size=4)
    first = make_seq(prompt_len=10, max_tokens=1)
    s.add_sequence(first)
    out = s.schedule()
    complete_step(s, out)
    s.finish_seq(first, SequenceStatus.FINISHED_LENGTH)
    complete_step(s, s.schedule())  # finalize: blocks go to the cache
    second = make_seq(prompt_len=12, max_tokens=1)  # same first 10 tokens
    s.add_sequence(second)
    out = s.schedule()
    assert second.num_prefix_hit_tokens == 8  # two full blocks of 4 were cached
    assert out.num_new_tokens == [4]
    same = make_seq(prompt_len=8)
    s2 = make_scheduler(block_size=4)
    s2.add_sequence(same)
    complete_step(s2, s2.schedule())
    twin = make_seq(prompt_len=8)
    s2.add_sequence(twin)
    s2.schedule()
    assert twin.num_prefix_hit_tokens == 4  # the block holding the last token is recomputed


def test_block_ref_counts_share_and_free():
    s = make_scheduler(num_blocks=16, block_size=4)
    start = s.block_manager.num_free_blocks
    a = make_seq(prompt_len=9, max_tokens=1)
    s.add_sequence(a)
    complete_step(s, s.schedule())
    b = make_seq(prompt_len=9, max_tokens=1)
    s.add_sequence(b)
    s.schedule()
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert all(s.block_manager.ref_counts[x] == 2 for x in shared)
    for q in (a, b):
        s.free_seq(q)
    assert s.block_manager.num_free_blocks == start
    with pytest.raises(RuntimeError, match="double free"):
        s.block_manager.release_block(shared[0])


def test_preemption_recompute_puts_newest_back_at_head_of_waiting():
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)
    old, new = make_seq(prompt_len=8, max_tokens=20), make_seq(prompt_len=8, max_tokens=20, first_token=100)
    s.add_sequence(old)
    s.add_sequence(new)
    new.arrival_time = old.arrival_time + 1
    complete_step(s, s.schedule())  # 4 blocks used, 1 free
    for _ in range(4):
        out = s.schedule()
        complete_step(s, out)
    # at some point the newest lost its KV and went back to waiting for recompute
    assert s.num_preemptions >= 1
    assert new in s.waiting and new.num_cached_tokens == 0 and not new.block_table
    assert old in s.running and not new.is_finished


def test_completion_preemption_stops_the_request_instead_of_recompute():  # invariant 3
    s = make_scheduler(EngineType.COMPLETION, num_blocks=5, block_size=4)
    a = handed_off(s, prompt_len=7)
    b = handed_off(s, prompt_len=7, first_token=100)
    b.arrival_time = a.arrival_time + 1
    for _ in range(6):
        complete_step(s, s.schedule())
    assert b.status == SequenceStatus.FINISHED_PREEMPTED and "preempted" in b.error
    assert not s.waiting  # nothing parked for a recompute that can never happen
    assert a in s.running


def test_completion_requires_stop_preempted_request():
    with pytest.raises(ValueError, match="stop_preempted_request"):
        make_scheduler(EngineType.COMPLETION, stop_preempted_request=False)


def test_add_sequence_reserves_capacity_only_for_normal():
    for role, reserves in ((EngineType.NORMAL, True), (EngineType.PROMPT, False), (EngineType.COMPLETION, False)):
        s = make_scheduler(role)
        seq = make_seq(prompt_len=8, max_tokens=8)
        s.add_sequence(seq)
        assert (seq.reserved_block_capacity > 0) == reserves, role
        if reserves:
            assert seq.reserved_block_capacity >= s.block_manager.blocks_needed(16)


def test_prompted_enter_running_first_and_forks_copy_a_half_written_last_block():
    s = make_scheduler(EngineType.NORMAL, block_size=4)
    parent = make_seq(prompt_len=6, max_tokens=8)
    s.add_sequence(parent)
    out = s.schedule()
    complete_step(s, out)  # prompt computed, one token sampled: len 7, cached 6
    child = s.fork_seq(parent, output_token_ids=[55])
    assert child in [e[0] for e in s.prompted]
    assert child.block_table == parent.block_table
    last = parent.block_table[-1]
    assert s.block_manager.ref_counts[last] == 2
    out = s.schedule()
    assert not out.prompt_run and child in out.scheduled_seqs
    assert out.clone_blocks == [(last, child.block_table[-1])] and child.block_table[-1] != last
    assert child.block_table[0] == parent.block_table[0]  # full blocks stay shared


def test_fork_checks():
    s = make_scheduler()
    fresh = make_seq()
    with pytest.raises(ValueError, match="computed prefix"):
        s.fork_seq(fresh)
    s.add_sequence(fresh)
    complete_step(s, s.schedule())
    with pytest.raises(ValueError, match="allocated KV blocks"):
        s.fork_seq(fresh, blocks=[])
    # an incomplete prompt goes to the front of waiting
    fresh.num_cached_tokens = 4
    child = s.fork_seq(fresh)
    assert s.waiting[0] is child


def test_abort_frees_queued_now_and_running_at_next_step():
    s = make_scheduler(num_blocks=32)
    start = s.block_manager.num_free_blocks
    run, wait = make_seq(request_id="r1"), make_seq(request_id="r2", first_token=100)
    s.add_sequence(run)
    complete_step(s, s.schedule())
    s.add_sequence(wait)
    s.abort_seq("r2")
    assert wait.status == SequenceStatus.FINISHED_ABORTED and wait not in s.waiting
    s.abort_seq("r1")
    assert run.status == SequenceStatus.FINISHED_ABORTED and run not in s.running
    out = s.schedule()
    assert out.finished_seqs == [run]
    complete_step(s, out)
    assert s.block_manager.num_free_blocks == start and not s.has_unfinished()


def test_prompt_over_limit_is_ignored_with_an_error():
    s = make_scheduler(max_model_len=16)
    seq = make_seq(prompt_len=20)
    s.add_sequence(seq)
    out = s.schedule()
    assert out.ignored_seqs == [seq] and seq.status == SequenceStatus.FINISHED_IGNORED and "exceeds" in seq.error
