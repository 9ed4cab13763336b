"""Loads that fail, run late or are aborted midway are dropped and recomputed (identical output, counted,
nothing left pinned), and engines of another model, dtype or block size never see each other's entries.
The PEs run in this process (white-box); their CE is a real process saving to the store."""

import dataclasses
import time

import pytest
import torch

from deepinfer_core.roles import EngineType
from deepinfer_core.transfer.storage_io import StorageError
from tests.helpers.kv_store import start_engine, store_config, wait_store_idle
from tests.helpers.pd import greedy, local_pe, normal_reference, reserve, run_pe, wait_ce

_ids = iter(range(10**6))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return store_config(tmp_path_factory.mktemp("kv-store"))


@pytest.fixture(scope="module")
def ce(store):
    engine = start_engine(EngineType.COMPLETION, num_gpu_blocks=512, kv_store=store)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def writer():
    return local_pe()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(pe, ce, prompt, params):
    rid = f"f-{next(_ids)}"
    pe.add_prefill(rid, reserve(ce, rid, prompt, params), params, prompt)
    results = run_pe(pe)
    assert all(r.ok for r in results), results
    return wait_ce(ce, [rid])[rid]


def _warm(writer, ce, prompt, params=None):
    _run(writer, ce, prompt, params or greedy(3))
    wait_store_idle(ce)


class _FaultyReads:
    """The store's real file mover, with reads that fail (or first wait)."""

    def __init__(self, io, delay_s: float = 0.0, fail: bool = True):
        self.io, self.name, self.delay_s, self.fail = io, io.name, delay_s, fail

    def write(self, items, timeout_s):
        self.io.write(items, timeout_s)

    def read(self, items, timeout_s):
        time.sleep(self.delay_s)
        if self.fail:
            raise StorageError("injected read failure")
        self.io.read(items, timeout_s)

    def close(self):
        self.io.close()


def _check_recomputed(pe, out, prompt, params, computed_before):
    assert out.outputs[0].token_ids == normal_reference([prompt], params)[0]
    assert out.num_cached_tokens == 0 and pe.num_computed_prompt_tokens - computed_before == len(prompt)
    stats = pe.kv_store_stats()
    assert stats.hit_tokens == 0 and stats.l2_pins == 0 and stats.inflight_loads == 0


def test_a_failed_load_is_counted_and_recomputed(store, ce, writer):
    prompt = _tokens(64, 1)
    _warm(writer, ce, prompt)
    pe = local_pe(kv_store=store)
    pe.kv_store.tier.io = _FaultyReads(pe.kv_store.tier.io)
    before = pe.num_computed_prompt_tokens
    out = _run(pe, ce, prompt + [3], greedy(8))
    _check_recomputed(pe, out, prompt + [3], greedy(8), before)
    assert pe.kv_store_stats().load_failures == 1


def test_a_load_past_its_deadline_is_dropped_and_recomputed(store, ce, writer):
    prompt = _tokens(64, 2)
    _warm(writer, ce, prompt)
    pe = local_pe(kv_store=dataclasses.replace(store, load_timeout_s=1e-6))
    before = pe.num_computed_prompt_tokens
    out = _run(pe, ce, prompt + [3], greedy(8))
    _check_recomputed(pe, out, prompt + [3], greedy(8), before)
    assert pe.kv_store_stats().load_timeouts == 1


def test_an_abort_while_loading_gives_back_blocks_and_slots(store, ce, writer):
    prompt = _tokens(64, 3)
    _warm(writer, ce, prompt)
    pe = local_pe(kv_store=store)
    pe.kv_store.tier.io = _FaultyReads(pe.kv_store.tier.io, delay_s=0.5, fail=False)
    rid = "abort-while-loading"
    pe.add_prefill(rid, reserve(ce, rid, prompt + [3], greedy(4)), greedy(4), prompt + [3])
    pe.step()
    assert len(pe.scheduler.loading) == 1 and pe.kv_store_stats().inflight_loads == 1
    pe.abort_request(rid)
    assert not pe.scheduler.loading and not pe.has_unfinished_requests()
    assert pe.scheduler.block_manager.num_free_blocks == pe.scheduler.block_manager.num_blocks
    deadline = time.monotonic() + 30
    while pe.kv_store_stats().inflight_loads:
        assert time.monotonic() < deadline
        pe.poll_handoffs()
        time.sleep(0.01)
    stats = pe.kv_store_stats()
    assert stats.l2_pins == 0 and stats.hit_tokens == 0
    assert stats.l2_bytes == 8 * pe.kv_store.pool.slot_bytes  # the read it no longer wanted still fills L2


def test_a_request_ended_by_its_first_token_is_saved_too(store, ce, writer):
    prompt = _tokens(40, 4)
    _warm(writer, ce, prompt, greedy(1))
    probe = local_pe(kv_store=store).probe_prefix(prompt + [1])
    assert probe.l3_tokens == 40 and probe.l1_tokens == probe.l2_tokens == 0


@pytest.mark.parametrize("other", [dict(dtype="bfloat16"), dict(block_size=16), dict(seed=1)], ids=str)
def test_another_model_dtype_or_block_size_never_shares_entries(store, ce, writer, other):
    prompt = _tokens(64, 5)
    _warm(writer, ce, prompt)
    assert local_pe(kv_store=store).probe_prefix(prompt + [1]).l3_tokens == 64  # the same engine would hit
    stranger = local_pe(kv_store=store, **other)
    assert stranger.probe_prefix(prompt + [1]).cached_tokens == 0
