"""MTP speculative decoding on the embedded tiny model: greedy output equals the non-speculative
output token for token, whatever the drafts; the role table's slot-pool row; stops, preemption and
aborts with drafts in flight free every block and slot."""

from __future__ import annotations

import pytest

from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.spec import oracle_drafts, role_environment

PROMPTS = [[5, 17, 99, 3], [400 + i for i in range(21)], [7]]
MAX_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def _env():
    with role_environment():
        yield


def _run(engine, prompts=PROMPTS, params=None) -> dict[str, list[int]]:
    for j, p in enumerate(prompts):
        engine.add_request(f"r{j}", params=params or greedy(MAX_TOKENS), prompt_token_ids=p)
    done = run_to_completion(engine)
    return {rid: o.outputs[0].token_ids for rid, o in done.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return _run(make_engine(num_speculative_tokens=0))


@pytest.mark.parametrize("nextn", [1, 2])
def test_greedy_equals_non_speculative(reference, nextn):
    engine = make_engine(num_speculative_tokens=nextn)
    assert _run(engine) == reference
    stats = engine.spec.slots.stats
    assert stats.draft_tokens > 0 and len(stats.proposed_at) == nextn
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert engine.spec.slots.num_free == engine.spec.slots.num_slots


@pytest.mark.parametrize("nextn", [1, 3])
def test_accepted_and_rejected_drafts_keep_the_output(monkeypatch, reference, nextn):
    """An oracle right at two output indices of three: accepted runs, rejections and rollbacks."""
    oracle_drafts(monkeypatch, reference, lambda i: i % 3 != 1, vocab=1024)
    engine = make_engine(num_speculative_tokens=nextn)
    assert _run(engine) == reference
    stats = engine.spec.slots.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    load = engine.load()
    assert (load.spec_draft_tokens, load.spec_accepted_tokens) == (stats.draft_tokens, stats.accepted_tokens)
    assert sum(load.spec_accepted_per_position) == stats.accepted_tokens


def test_all_drafts_right_emits_nextn_plus_one_per_step(monkeypatch, reference):
    oracle_drafts(monkeypatch, reference, lambda i: True, vocab=1024)
    engine = make_engine(num_speculative_tokens=2)
    engine.add_request("r1", params=greedy(MAX_TOKENS), prompt_token_ids=PROMPTS[1])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 1 + (MAX_TOKENS - 1 + 2) // 3 + 1  # prefill, 3 tokens a step, the step that frees
    stats = engine.spec.slots.stats
    assert stats.accepted_tokens == stats.draft_tokens == 12  # no draft verified past max_tokens


def test_stop_token_inside_accepted_drafts(monkeypatch, reference):
    """A stop token among accepted drafts ends the output there; the later ones are never output."""
    oracle_drafts(monkeypatch, reference, lambda i: True, vocab=1024)
    stop = reference["r1"][7]
    params = greedy(MAX_TOKENS, stop_token_ids=[stop])
    base = _run(make_engine(num_speculative_tokens=0), [PROMPTS[1]], params)
    engine = make_engine(num_speculative_tokens=3)
    assert _run(engine, [PROMPTS[1]], params) == base
    assert base["r0"][-1] == stop and len(base["r0"]) < MAX_TOKENS
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_preemption_for_recompute_keeps_the_output(monkeypatch, reference):
    """NORMAL without stop_preempted_request: a preempted sequence loses its slot and drafts with its
    blocks, is prefilled again (its MTP KV too) and ends as without speculation."""
    oracle_drafts(monkeypatch, reference, lambda i: i % 2 == 0, vocab=1024)
    engine = make_engine(num_speculative_tokens=2, num_gpu_blocks=9)
    assert _run(engine) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec.slots.num_free == engine.spec.slots.num_slots


def test_preemption_and_abort_with_drafts_free_everything(monkeypatch, reference):
    oracle_drafts(monkeypatch, reference, lambda i: i % 2 == 0, vocab=1024)
    engine = make_engine(num_speculative_tokens=2, num_gpu_blocks=10, stop_preempted_request=True)
    bm, slots = engine.scheduler.block_manager, engine.spec.slots
    for j, p in enumerate(PROMPTS):
        engine.add_request(f"r{j}", params=greedy(40), prompt_token_ids=p)
    for _ in range(4):
        engine.step()
    assert slots.num_free < slots.num_slots  # drafts in flight
    engine.abort_request("r0")
    done = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert any(o.outputs[0].finish_reason == "preempted" for o in done.values())
    engine.step()  # releases what the last step finished
    assert bm.num_free_blocks == bm.num_blocks
    assert slots.num_free == slots.num_slots


def test_ineligible_rows_decode_without_drafts(reference):
    """Penalties and logprobs read the plain sampler: those sequences feed one token, others draft."""
    engine = make_engine(num_speculative_tokens=2)
    engine.add_request("pen", params=greedy(8, repetition_penalty=1.3), prompt_token_ids=PROMPTS[0])
    engine.add_request("lp", params=greedy(8, logprobs=2), prompt_token_ids=PROMPTS[0])
    engine.add_request("r1", params=greedy(MAX_TOKENS), prompt_token_ids=PROMPTS[1])
    done = run_to_completion(engine)
    plain = make_engine(num_speculative_tokens=0)
    plain.add_request("pen", params=greedy(8, repetition_penalty=1.3), prompt_token_ids=PROMPTS[0])
    plain.add_request("lp", params=greedy(8, logprobs=2), prompt_token_ids=PROMPTS[0])
    ref = run_to_completion(plain)
    for rid in ("pen", "lp"):
        assert done[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
    assert len(done["lp"].outputs[0].logprobs) == 8
    assert done["r1"].outputs[0].token_ids == reference["r1"]


def test_slot_pool_follows_the_role_table():
    """SPEC §1: NORMAL and COMPLETION build a pool of max_num_seqs slots; a PE builds none and loads
    no draft-only weights; a CE reserves 1 + nextn tokens per sequence in its profile and MoE bound."""
    pe = make_engine(EngineType.PROMPT, num_speculative_tokens=2)
    assert pe.spec is None and pe.worker.draft is None and pe.scheduler.draft_slots is None
    assert pe.cache.draft_kv_buffer.shape[0] == 0
    assert not any("block." in n or "eh_proj" in n for n, _ in pe.worker.model.named_parameters())
    for role in (EngineType.NORMAL, EngineType.COMPLETION):
        engine = make_engine(role, num_speculative_tokens=2, max_num_seqs=6)
        assert engine.spec.slots.num_slots == 6 and engine.cache.draft_kv_buffer.shape[0] == 1
        assert engine.scheduler.draft_slots is engine.spec.slots
    ce = make_engine(EngineType.COMPLETION, num_speculative_tokens=2, max_num_seqs=6)
    assert ce.config.scheduler.max_step_tokens == 6 * 3
    assert ce.worker.runner.profile_shapes() == [(3, 3)] * 6


def test_env_selects_nextn(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "1")
    from deepinfer_core import envs

    envs.rearm("DEEPINFER_USE_NEXTN_DECODE")
    try:
        engine = make_engine()
        assert engine.spec is not None and engine.spec.nextn == 1
        assert not engine.zero_overhead_scheduling
    finally:
        monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
        envs.rearm("DEEPINFER_USE_NEXTN_DECODE")


def test_sampled_requests_draft_and_finish():
    engine = make_engine(num_speculative_tokens=2)
    out = _run(engine, PROMPTS, SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True))
    assert all(len(t) == 12 for t in out.values())
    assert engine.spec.slots.stats.draft_tokens > 0


def test_drafts_stop_at_max_model_len(monkeypatch):
    """Near max_model_len a step verifies only the drafts whose positions exist."""
    prompt, max_len = PROMPTS[1], 36
    ref = _run(make_engine(num_speculative_tokens=0, max_model_len=max_len), [prompt], greedy(100))
    oracle_drafts(monkeypatch, ref, lambda i: True, vocab=1024)
    engine = make_engine(num_speculative_tokens=3, max_model_len=max_len)
    out = _run(engine, [prompt], greedy(100))
    assert out == ref and len(prompt) + len(out["r0"]) == max_len
    assert engine.spec.slots.stats.accepted_tokens == engine.spec.slots.stats.draft_tokens


def test_forks_draft_on_their_own(reference):
    """n > 1: the samples fork after the first token, each takes its own slot, none inherits one."""
    engine = make_engine(num_speculative_tokens=2)
    engine.add_request("r1", params=greedy(MAX_TOKENS, n=2), prompt_token_ids=PROMPTS[1])
    (out,) = run_to_completion(engine).values()
    assert [o.token_ids for o in out.outputs] == [reference["r1"]] * 2
    engine.step()
    assert engine.spec.slots.num_free == engine.spec.slots.num_slots
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
