"""Zero-overhead scheduling (SPEC §1, deepinfer_core/engine/overlap.py) on the embedded model.

With it on, a `step()` call launches the next step before it reads the previous one back, and
outputs come one call later. What a request ends up with must not change: the same workloads
run with overlap off and on, and their outputs are compared field by field.

Exactness: the CPU kernels are not batch-invariant (a matmul over another number of rows can
change the last bits of every row). Where the two modes run the same batches (every end known
from counts: max_tokens, max_model_len; forks; penalties) the comparison is exact, logprobs
included. A sequence that EOS, a stop token or a stop string ends (or that is aborted) is
still in the next, already launched batch (its extra sample is dropped), so the other rows of
that one step may differ in the last bits: those workloads compare tokens, text and finish
reasons exactly and logprob values to 1e-5.
"""

from __future__ import annotations

import pytest

from deepinfer_core.engine.overlap import PLACEHOLDER
from deepinfer_core.pd.completion_engine import CompletionEngine
from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from tests.helpers.engines import copy_handoff, greedy, prefill_on
from tests.helpers.images import make_png
from tests.helpers.overlap import (
    StepTrace,
    assert_same_outputs,
    drive,
    output_fields,
    overlap_engine,
    overlap_prompts,
    watch_hashing,
)

IMAGE = 1022  # <|image|> of the embedded model's tokenizer


def _length_workload(prompts):
    """Every request ends by a count (max_tokens / ignore_eos), so both modes run the same batches."""
    seeded = dict(temperature=0.9, ignore_eos=True)
    first = [
        ("greedy-lp", prompts[0], greedy(9, logprobs=3), None),
        ("seeded-plp", prompts[1], SamplingParams(seed=11, max_tokens=14, prompt_logprobs=2, **seeded), None),
        ("n3", prompts[3], SamplingParams(n=3, seed=5, max_tokens=6, logprobs=1, **seeded), None),
        ("topkp", prompts[2], SamplingParams(seed=3, top_k=20, top_p=0.9, min_p=0.01, max_tokens=11, **seeded), None),
        ("min-tokens", prompts[4], SamplingParams(temperature=0, min_tokens=5, max_tokens=7), None),
        ("image", [1018, 5, IMAGE, 6, 7], greedy(8, logprobs=2), {"image": make_png(seed=3)}),
        ("one-token", prompts[4][:6], greedy(1), None),
        ("greedy-n2", prompts[2], SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True), None),
        ("n3-one-token", prompts[0], SamplingParams(n=3, seed=9, max_tokens=1, **seeded), None),  # forks end at once
    ]
    # added mid-run: prefix-cache hits on the first wave's committed blocks
    later = [
        ("hit-1", prompts[1] + prompts[0], greedy(10, logprobs=2), None),
        ("hit-2", prompts[3] + prompts[2], SamplingParams(seed=21, max_tokens=9, **seeded), None),
    ]
    return first, later


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(),
        dict(chunked_prefill=True, max_num_batched_tokens=16),  # long prompts take several chunks
    ],
    ids=["whole-prompts", "chunked-prefill"],
)
def test_length_workload_equals_synchronous_exactly(engine_kw):
    results = {}
    for zos in (False, True):
        engine = overlap_engine(zos, **engine_kw)
        free0 = engine.scheduler.block_manager.num_free_blocks
        first, later = _length_workload(overlap_prompts(engine))
        trace = StepTrace(engine)
        hashed = watch_hashing(engine)
        results[zos], _ = drive(engine, first, later, add_later_at=4)
        results[zos, "batches"] = trace.scheduled
        assert sum(hashed) > 0
        assert engine.scheduler.block_manager.num_free_blocks == free0
    assert results[False, "batches"] == results[True, "batches"]  # the very same steps ran
    assert_same_outputs(results[False], results[True])
    assert results[True]["hit-1"].num_cached_tokens > 0 and results[True]["hit-2"].num_cached_tokens > 0
    assert len(results[True]["n3"].outputs) == 3


def test_stops_and_abort_equal_synchronous():
    ref = overlap_engine(False)
    prompts = overlap_prompts(ref)
    want = drive(ref, [("r", prompts[0], greedy(16), None)])[0]["r"].outputs[0]
    stop_token, stop_str = want.token_ids[4], want.text[6:9]
    first = [
        ("stop-token", prompts[0], greedy(16, stop_token_ids=[stop_token], logprobs=2), None),
        ("stop-str", prompts[0], greedy(16, stop=[stop_str]), None),
        ("stop-str-kept", prompts[0], greedy(16, stop=[stop_str], include_stop_str_in_output=True), None),
        ("eos-allowed", prompts[3], SamplingParams(temperature=0.8, seed=4, max_tokens=12), None),
        ("long", prompts[1], greedy(20, logprobs=1), None),
        ("aborted", prompts[4], greedy(30), None),
        ("seeded", prompts[2], SamplingParams(temperature=1.0, seed=8, max_tokens=18, ignore_eos=True), None),
        ("n2-stop", prompts[0], SamplingParams(n=2, temperature=0, max_tokens=16, stop=[stop_str]), None),
    ]
    results, streams = {}, {}
    for zos in (False, True):
        engine = overlap_engine(zos)
        free0 = engine.scheduler.block_manager.num_free_blocks
        results[zos], streams[zos] = drive(engine, first, abort_at={"aborted": 5})
        assert engine.scheduler.block_manager.num_free_blocks == free0
        assert not engine.requests
    assert_same_outputs(results[False], results[True], exact_logprobs=False)
    assert results[True]["stop-token"].outputs[0].stop_reason == stop_token
    assert results[True]["stop-str"].outputs[0].finish_reason == "stop"
    assert "aborted" not in results[True]
    # the abort came after the same 5 tokens in both modes; its in-flight sample is never reported
    last = {zos: [o for o in streams[zos] if o.request_id == "aborted"][-1].outputs[0] for zos in (False, True)}
    assert last[False].token_ids == last[True].token_ids and len(last[True].token_ids) == 5


def test_the_next_step_launches_before_this_one_is_read_back():
    engine = overlap_engine(True)
    trace = StepTrace(engine)
    prompts = overlap_prompts(engine)
    requests = [(f"r{i}", p, greedy(6), None) for i, p in enumerate(prompts[:3])]
    for rid, ids, params, _ in requests:
        engine.add_request(rid, params=params, prompt_token_ids=ids)
    assert engine.step() == []  # the first call only launches
    assert engine.has_unfinished_requests()  # the step in flight counts
    drive(engine, [])
    launches = [k for kind, k in trace.events if kind == "launch" and trace.scheduled[k]]
    assert len(launches) >= 6
    for k in launches[:-1]:  # every step but the last: step k + 1 is launched before k is read back
        assert trace.events.index(("launch", k + 1)) < trace.events.index(("result", k))
    # the synchronous engine reads every step back before the next launch
    sync = overlap_engine(False)
    trace = StepTrace(sync)
    drive(sync, requests)
    for k in range(len(trace.scheduled) - 1):
        assert trace.events.index(("result", k)) < trace.events.index(("launch", k + 1))


def test_outputs_stream_every_token_one_call_later():
    per_call = {}
    for zos in (False, True):
        engine = overlap_engine(zos)
        engine.add_request("r", params=greedy(5), prompt_token_ids=overlap_prompts(engine)[0])
        calls = []
        while engine.has_unfinished_requests():
            calls.append([len(o.outputs[0].token_ids) for o in engine.step()])
        per_call[zos] = calls
    assert per_call[False][:5] == [[1], [2], [3], [4], [5]]
    assert per_call[True][:6] == [[], [1], [2], [3], [4], [5]]


def test_a_finished_sequences_extra_sample_is_dropped_and_its_blocks_return():
    ref = overlap_engine(False)
    ids = overlap_prompts(ref)[3]
    want = drive(ref, [("r", ids, greedy(12), None)])[0]["r"].outputs[0].token_ids
    stop_at = 1
    while want[stop_at] in want[:stop_at]:
        stop_at += 1
    assert stop_at < 10  # a stop token, not the max_tokens cap, ends it
    engine = overlap_engine(True)
    trace = StepTrace(engine)
    free0 = engine.scheduler.block_manager.num_free_blocks
    out, stream = drive(engine, [("r", ids, greedy(12, stop_token_ids=[want[stop_at]]), None)])
    assert out["r"].outputs[0].token_ids == want[: stop_at + 1]
    assert out["r"].outputs[0].finish_reason == "stop"
    # one step more ran for it than it has tokens: that sample was never appended or reported
    assert sum(ids == ["r"] for ids in trace.scheduled) == stop_at + 2
    assert all(len(o.outputs[0].token_ids) <= stop_at + 1 for o in stream)
    assert engine.scheduler.block_manager.num_free_blocks == free0
    assert not engine.has_unfinished_requests()


def test_penalties_fall_back_to_synchronous_steps_and_stay_identical():
    penalised = [
        ("rep", SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True)),
        ("pres", SamplingParams(temperature=0.9, seed=2, presence_penalty=0.7, max_tokens=9, ignore_eos=True)),
        ("freq", SamplingParams(temperature=0, frequency_penalty=1.1, max_tokens=8, ignore_eos=True, logprobs=2)),
        ("plain", greedy(12, logprobs=2)),
    ]
    results, traces = {}, {}
    for zos in (False, True):
        engine = overlap_engine(zos)
        prompts = overlap_prompts(engine)
        traces[zos] = StepTrace(engine)
        requests = [(rid, prompts[i], p, None) for i, (rid, p) in enumerate(penalised)]
        results[zos], _ = drive(engine, requests)
    assert_same_outputs(results[False], results[True])
    trace = traces[True]
    for k, rids in enumerate(trace.scheduled[:-1]):
        if {"rep", "pres", "freq"} & set(rids):  # read back before the next step was scheduled
            assert trace.events.index(("result", k)) < trace.events.index(("launch", k + 1))
    # once only "plain" is left, the steps overlap again
    last_penalised = max(k for k, rids in enumerate(trace.scheduled) if {"rep", "pres", "freq"} & set(rids))
    k = last_penalised + 1
    assert trace.scheduled[k] == ["plain"] and trace.scheduled[k + 1] == ["plain"]
    assert trace.events.index(("launch", k + 1)) < trace.events.index(("result", k))


@pytest.mark.parametrize("stop_preempted", [False, True], ids=["recompute", "stop"])
def test_preemption_with_a_small_kv_pool_equals_synchronous(stop_preempted):
    results = {}
    for zos in (False, True):
        # 12 blocks of 8 tokens cannot hold five growing sequences at once
        engine = overlap_engine(zos, num_gpu_blocks=12, block_size=8, stop_preempted_request=stop_preempted)
        prompts = overlap_prompts(engine)
        requests = [(f"r{i}", p[:20], greedy(30, logprobs=1), None) for i, p in enumerate(prompts)]
        trace = StepTrace(engine)
        watch_hashing(engine)
        results[zos], _ = drive(engine, requests)
        results[zos, "batches"] = trace.scheduled
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.block_manager.num_free_blocks == 12
    assert results[False, "batches"] == results[True, "batches"]
    assert_same_outputs(results[False], results[True])
    reasons = {o.outputs[0].finish_reason for o in results[True].values()}
    assert ("preempted" in reasons) == stop_preempted


def test_preempting_a_sequence_whose_token_is_in_flight():
    """Recompute preemption of a sequence that holds a placeholder: it re-enters `waiting`, the
    token comes back into it, and its recompute includes that token."""
    engine = overlap_engine(True, num_gpu_blocks=12, block_size=8)
    prompts = overlap_prompts(engine)
    requests = [(f"r{i}", p[:20], greedy(30), None) for i, p in enumerate(prompts)]
    seen = []
    preempt = engine.scheduler._preempt_newest

    def watched(candidates, out):
        before = list(engine.scheduler.waiting)
        ok = preempt(candidates, out)
        seen.extend(s.output_token_ids[-1] == PLACEHOLDER for s in engine.scheduler.waiting if s not in before)
        return ok

    engine.scheduler._preempt_newest = watched
    done, _ = drive(engine, requests)
    assert any(seen)
    ref = overlap_engine(False, num_gpu_blocks=256)
    want, _ = drive(ref, requests)
    assert [done[r].outputs[0].token_ids for r in sorted(done)] == [want[r].outputs[0].token_ids for r in sorted(want)]


def test_completion_engine_overlaps_and_keeps_its_hand_off_abort_and_lease_paths():
    pytest.importorskip("nixl")  # a CE registers its KV cache with a NIXL agent
    pe = overlap_engine(False, EngineType.PROMPT)
    prompts = overlap_prompts(pe)
    results = {}
    for zos in (False, True):
        ce = overlap_engine(zos, EngineType.COMPLETION, cls=CompletionEngine)
        free0 = ce.scheduler.block_manager.num_free_blocks
        for i, p in enumerate(prompts):
            params = greedy(8 + i, logprobs=1)
            seq = prefill_on(pe, f"{zos}-{i}", p, params)
            copy_handoff(pe, seq, ce, params)
        ce.reserve("expiring", greedy(4), prompts[0], lease_s=0.0)  # never handed off
        ce.lease_grace_s = 0.0
        done, stream = {}, []
        for _ in range(200):
            if not ce.has_unfinished_requests() and not ce.reservations and not ce.quarantine:
                break
            outs = ce.poll_handoffs() + ce.step()
            for o in outs:
                stream.append(o)
                if o.finished:
                    done[o.request_id.split("-")[-1]] = o
                if o.request_id == f"{zos}-2" and len(o.outputs[0].token_ids) >= 4:
                    ce.abort_request(o.request_id)
        for _ in range(3):  # let the pool settle (blocks of the ended ones are released one step on)
            ce.step()
        results[zos] = done
        assert "2" not in done and "expiring" in done and done["expiring"].outputs[0].error
        assert ce.scheduler.block_manager.num_free_blocks == free0
    sync, zos = results[False], results[True]
    assert sync.keys() == zos.keys()
    for k in sync:
        assert output_fields(sync[k], exact_logprobs=False)[3] == output_fields(zos[k], exact_logprobs=False)[3], k


def test_switching_overlap_off_finishes_the_step_in_flight():
    engine = overlap_engine(True)
    engine.add_request("r", params=greedy(4), prompt_token_ids=overlap_prompts(engine)[0])
    assert engine.step() == [] and engine._step_in_flight is not None
    engine.zero_overhead_scheduling = False
    outs = engine.step()  # the prefill (in flight) and the first decode
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2] and engine._step_in_flight is None
    done, _ = drive(engine, [])
    assert len(done["r"].outputs[0].token_ids) == 4


def test_streaming_core_streams_every_token_and_goes_idle():
    """The services' engine thread (EngineHost via a colocated DecodeCore) keeps stepping while
    a step is in flight: every token reaches its stream, in order, and every request finishes."""
    import asyncio

    from services.common.workers import POOL_COLOCATED
    from services.workers.decode_core import DecodeCore
    from services.workers.spec import EngineSettings, WorkerSpec
    from services.workers.worker_server import build_engine

    args = dict(device="cpu", num_gpu_blocks=128, max_model_len=256, block_size=8)
    ref = overlap_engine(False)
    prompts = overlap_prompts(ref)[:4]
    params = [greedy(6 + 3 * i) for i in range(len(prompts))]
    want = drive(ref, [(f"r{i}", p, params[i], None) for i, p in enumerate(prompts)])[0]

    async def one(core, i):
        tokens, finish = [], None
        async for delta in core.generate(f"r{i}", prompts[i], params[i]):
            assert delta.token_offset == len(tokens)  # nothing skipped, nothing resent
            tokens += delta.token_ids
            finish = delta.finish_reason or finish
        return tokens, finish

    async def run():
        engine = build_engine(WorkerSpec("normal-0", POOL_COLOCATED, EngineSettings(**args)))
        engine.zero_overhead_scheduling = True
        core = DecodeCore(engine, "normal-0")
        core.start()
        try:
            got = await asyncio.gather(*(one(core, i) for i in range(len(prompts))))
            for _ in range(100):
                if not engine.has_unfinished_requests() and core.stats().requests == 0:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the load snapshot follows the engine thread
            return got, core.stats(), engine.has_unfinished_requests()
        finally:
            core.stop()

    got, load, busy = asyncio.run(run())
    assert got == [(want[f"r{i}"].outputs[0].token_ids, "length") for i in range(len(prompts))]
    assert not busy and load.requests == 0 and load.free_blocks == load.num_blocks
