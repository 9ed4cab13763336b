"""SPEC §5 invariants 2, 5 and 7 with a real PE (this process) writing into a real CE process;
and registration, not a request, pays for preparing the CE's transfer descriptors."""

import itertools

import pytest

from deepinfer_core import envs
from deepinfer_core.pd.prompt_engine import PromptEngine
from tests.helpers.pd import (
    ENGINE_ARGS,
    greedy,
    local_pe,
    normal_reference,
    reserve,
    run_pe,
    start_ce,
    wait_ce,
    wait_free_blocks,
)


class Watched(PromptEngine):
    """Records step kinds, finalize calls, and whether handed-off blocks stay owned while in flight."""

    def __init__(self, *a, **kw):
        self.steps, self.finalized, self.inflight_blocks_owned = [], [], []
        super().__init__(*a, **kw)

    def finalize_seq(self, seq):
        self.finalized.append(seq)
        super().finalize_seq(seq)

    def pe_prepare_save_kvcache(self, scheduled, finished):
        super().pe_prepare_save_kvcache(scheduled, finished)
        self._check_owned()

    def pe_do_save_kvcache(self, scheduled, finished):
        self._check_owned()  # before the wait: the write may still be reading these blocks
        super().pe_do_save_kvcache(scheduled, finished)

    def _check_owned(self):
        bm = self.scheduler.block_manager
        for pending in self._inflight + [p for p in self._streams.values() if p.transfers]:
            blocks = pending.seq.block_table
            owned = bool(blocks) and all(bm.ref_counts[b] > 0 for b in blocks)
            free = set(bm._free) | set(bm._evictable)
            self.inflight_blocks_owned.append(owned and not (set(blocks) & free))

    def step(self):
        out = self.scheduler.schedule
        recorded = []

        def schedule():
            o = out()
            recorded.append((o.prompt_run, len(o.scheduled_seqs)))
            return o

        self.scheduler.schedule = schedule
        try:
            return super().step()
        finally:
            self.scheduler.schedule = out
            self.steps += recorded


class FreesEarly(Watched):
    """The bug invariant 5 forbids: release the PE's blocks as soon as the write is posted."""

    def pe_prepare_save_kvcache(self, scheduled, finished):
        PromptEngine.pe_prepare_save_kvcache(self, scheduled, finished)
        bm = self.scheduler.block_manager
        for pending in self._inflight:
            for block in pending.seq.block_table:  # returned to the pool while the write runs
                bm.release_block(block)
        self._check_owned()
        for pending in self._inflight:  # re-take them so the rest of the step stays consistent
            for block in pending.seq.block_table:
                bm._free.remove(block) if block in bm._free else bm._evictable.pop(block)
                bm.ref_counts[block] = 1


@pytest.fixture(scope="module")
def ce():
    proc = start_ce()
    yield proc
    proc.close()


_ids = itertools.count()


def _handoff(pe, ce, prompts, max_tokens=6):
    ids = []
    for p in prompts:
        rid = f"inv-{next(_ids)}"  # unique in the module: the CE is shared (an id(pe) may be reused)
        target = reserve(ce, rid, p, greedy(max_tokens))
        pe.add_prefill(rid, target, greedy(max_tokens), p)
        ids.append(rid)
    results = run_pe(pe)
    return ids, results


def test_invariants_2_5_7_under_real_transfers(ce):
    pe = local_pe(Watched, chunked_prefill=True, max_num_batched_tokens=24)
    free0 = pe.scheduler.block_manager.num_free_blocks
    prompts = [list(range(1, 40)), [7, 8, 9], list(range(100, 117))]
    ids, results = _handoff(pe, ce, prompts)
    assert all(r.ok for r in results) and len(results) == 3
    done = wait_ce(ce, ids)
    assert all(len(done[i].outputs[0].token_ids) == 6 for i in ids)
    # 2: every non-empty PROMPT step is a prefill step
    assert all(prompt_run for prompt_run, n in pe.steps if n > 0)
    # 5: never finalize_seq; blocks stay owned while the write is in flight, freed after hand-off
    assert pe.finalized == []
    assert pe.inflight_blocks_owned and all(pe.inflight_blocks_owned)
    assert pe.scheduler.block_manager.num_free_blocks == free0
    # 7: an idle PE step is an empty prefill step, never a fall to decode
    out = pe.scheduler.schedule()
    assert out.prompt_run and out.is_empty
    assert wait_free_blocks(ce, ENGINE_ARGS["num_gpu_blocks"]) == ENGINE_ARGS["num_gpu_blocks"]


def test_the_ownership_check_catches_early_freeing(ce):
    pe = local_pe(FreesEarly)
    _handoff(pe, ce, [list(range(1, 30))])
    assert not all(pe.inflight_blocks_owned)


def test_registration_prepares_the_ce_descriptors_so_no_hand_off_does(ce, monkeypatch):
    pe = local_pe()
    pe.connect_peer(ce.info["agent_name"], ce.info["agent_metadata"], ce.info["kv_region"])
    assert pe.agent.num_remote_lists == 1  # before any request
    prepared = []
    real = pe.agent._agent.prep_xfer_dlist
    monkeypatch.setattr(pe.agent._agent, "prep_xfer_dlist", lambda *a: prepared.append(a[0]) or real(*a))
    ids, results = _handoff(pe, ce, [list(range(1, 20)), [4, 5, 6]], max_tokens=3)
    assert len(results) == 2 and all(r.ok for r in results)
    assert prepared == [] and pe.agent.num_remote_lists == 1
    done = wait_ce(ce, ids)
    assert all(len(done[i].outputs[0].token_ids) == 3 for i in ids)


def _record_writes(pe, monkeypatch) -> list[list[int]]:
    writes, real = [], pe.agent.prepare_write
    monkeypatch.setattr(
        pe.agent,
        "prepare_write",
        lambda peer, local, *a, **kw: writes.append(list(local)) or real(peer, local, *a, **kw),
    )
    return writes


@pytest.mark.parametrize("stream", [True, False])
def test_chunked_prompt_streams_its_full_blocks_while_later_chunks_compute(ce, monkeypatch, stream):
    monkeypatch.setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", stream)
    pe = local_pe(Watched, chunked_prefill=True, max_num_batched_tokens=24)  # 8-token blocks: 3 per chunk
    free0 = pe.scheduler.block_manager.num_free_blocks
    writes = _record_writes(pe, monkeypatch)
    prompt = list(range(1, 70))  # 69 tokens: chunks of 24, 24, 21; 9 blocks
    ids, results = _handoff(pe, ce, [prompt])
    (r,) = results
    assert r.ok and r.num_bytes == 9 * pe.layout.num_layers * pe.layout.block_bytes
    # streamed: each chunk's full blocks, then the rest with the hand-off; else all at the end
    assert [len(w) for w in writes] == ([3, 3, 3] if stream else [9])
    assert len({b for w in writes for b in w}) == 9
    assert pe.inflight_blocks_owned and all(pe.inflight_blocks_owned)
    assert pe.scheduler.block_manager.num_free_blocks == free0
    out = wait_ce(ce, ids)[ids[0]].outputs[0].token_ids
    assert out == normal_reference([prompt], greedy(6))[0]


def test_abort_mid_prompt_waits_for_the_chunk_write_and_frees_both_sides(ce, monkeypatch):
    monkeypatch.setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", True)
    pe = local_pe(chunked_prefill=True, max_num_batched_tokens=24)
    free0 = pe.scheduler.block_manager.num_free_blocks
    writes = _record_writes(pe, monkeypatch)
    rid = f"inv-{next(_ids)}"
    prompt = list(range(1, 70))
    pe.add_prefill(rid, reserve(ce, rid, prompt, greedy(4)), greedy(4), prompt)
    monkeypatch.setattr(pe.agent, "reap", lambda transfer: False)  # as if the write were still running
    pe.step()  # the first chunk computes; its 3 full blocks are posted behind the next chunk's forward
    assert writes == []
    pe.step()
    assert [len(w) for w in writes] == [3] and rid in pe._streams
    (inflight,) = pe._streams[rid].transfers
    done0 = pe.agent.transfers_done
    pe.abort_request(rid)
    assert inflight.handle is None and pe.agent.transfers_done == done0 + 1  # waited for before the free
    assert not pe._streams and not pe.has_unfinished_requests()
    assert pe.scheduler.block_manager.num_free_blocks == free0
    assert wait_free_blocks(ce, ENGINE_ARGS["num_gpu_blocks"]) == ENGINE_ARGS["num_gpu_blocks"]


class _LayerEvent:
    """Stands in for a layer's CUDA event on CPU: logs when the PE waits for it."""

    def __init__(self, log: list, layer: int):
        self.log, self.layer = log, layer

    def synchronize(self):
        self.log.append(("wait", self.layer))


def test_the_hand_off_goes_out_in_layer_groups_each_after_its_layers_are_written(ce, monkeypatch):
    from deepinfer_core.models.layers import decoder

    monkeypatch.setattr(envs, "DEEPINFER_PD_LAYER_GROUPS", 2)
    pe = local_pe(Watched, chunked_prefill=True, max_num_batched_tokens=24)
    free0 = pe.scheduler.block_manager.num_free_blocks
    num_layers = pe.layout.num_layers
    assert pe.worker.runner.want_layer_events and num_layers == 3
    log, made = [], []

    def queue_event(device):
        made.append(_LayerEvent(log, len(made) % num_layers))
        return made[-1]

    monkeypatch.setattr(decoder, "_queue_event", queue_event)
    real_prepare, real_post = pe.agent.prepare_write, pe.agent.post

    def prepare(peer, local, *a, layers=None):
        log.append(("prepare", len(local), (layers.start, layers.stop) if layers is not None else None))
        write = real_prepare(peer, local, *a, layers=layers)
        write.log_as = log[-1][1:]
        return write

    def post(write):
        log.append(("post", *write.log_as))
        return real_post(write)

    monkeypatch.setattr(pe.agent, "prepare_write", prepare)
    monkeypatch.setattr(pe.agent, "post", post)
    prompt = list(range(1, 70))  # chunks of 24, 24, 21 tokens; 9 blocks of 8
    ids, results = _handoff(pe, ce, [prompt])
    (r,) = results
    assert r.ok and r.num_bytes == 9 * num_layers * pe.layout.block_bytes
    posts = [e for e in log if e[0] == "post"]
    # chunks 1 and 2: all layers at once; the last chunk: layers [0, 2) once layer 1 is written, then [2, 3)
    assert posts == [("post", 3, None), ("post", 3, None), ("post", 3, (0, 2)), ("post", 3, (2, 3))]
    # both groups' requests are made before the PE waits for the first layer event, while the forward runs
    tail = log[max(i for i, e in enumerate(log) if e == ("post", 3, None)) + 1 :]
    assert tail == [
        ("prepare", 3, (0, 2)),
        ("prepare", 3, (2, 3)),
        ("wait", 1),
        ("post", 3, (0, 2)),
        ("wait", 2),
        ("post", 3, (2, 3)),
    ]
    assert all(pe.inflight_blocks_owned) and pe.scheduler.block_manager.num_free_blocks == free0
    out = wait_ce(ce, ids)[ids[0]].outputs[0].token_ids
    assert out == normal_reference([prompt], greedy(6))[0]
