"""Failed hand-offs leak nothing and end with a clear error: a CE killed mid-transfer,
a refused layout fingerprint, an expired reservation lease."""

import dataclasses
import time

import pytest

from benchmarks.pd_harness import RemoteError
from deepinfer_core import envs
from deepinfer_core.config import PDConfig
from deepinfer_core.errors import KVTargetRejected
from deepinfer_core.pd.prompt_engine import PromptEngine
from tests.helpers.pd import ENGINE_ARGS, greedy, local_pe, reserve, run_pe, start_ce, wait_ce, wait_free_blocks

N = ENGINE_ARGS["num_gpu_blocks"]


class KillsPeerMidTransfer(PromptEngine):
    """Kills the CE process right after the KV write has been posted, before it is waited for."""

    victim = None

    def pe_prepare_save_kvcache(self, scheduled, finished):
        super().pe_prepare_save_kvcache(scheduled, finished)
        if self._inflight and self.victim is not None:
            self.victim.kill()


@pytest.mark.parametrize("pe_thread", ["1", "0"])  # "0": how a PE with a GPU cache runs
def test_ce_killed_mid_transfer_frees_pe_blocks_and_reports_the_error(monkeypatch, pe_thread):
    monkeypatch.setattr(envs, "DEEPINFER_NIXL_PROGRESS_THREAD", pe_thread)
    ce = start_ce()
    pe = local_pe(KillsPeerMidTransfer, transfer_timeout_s=5.0)
    free0 = pe.scheduler.block_manager.num_free_blocks
    prompt = list(range(1, 120))
    target = reserve(ce, "doomed", prompt, greedy(8))
    pe.victim = ce
    pe.add_prefill("doomed", target, greedy(8), prompt)
    started = time.monotonic()
    results = run_pe(pe)
    assert time.monotonic() - started < 60
    (r,) = results
    assert not r.ok and r.error and "doomed" not in pe.requests
    assert not ce.alive
    assert pe.scheduler.block_manager.num_free_blocks == free0
    assert not pe.has_unfinished_requests()
    # the PE keeps serving: a new CE, a new hand-off
    ce2 = start_ce()
    try:
        pe.victim = None
        target = reserve(ce2, "next", [5, 6, 7], greedy(3))
        pe.add_prefill("next", target, greedy(3), [5, 6, 7])
        assert all(x.ok for x in run_pe(pe))
        assert len(wait_ce(ce2, ["next"])["next"].outputs[0].token_ids) == 3
    finally:
        ce2.close()


class KillsPeerMidStream(PromptEngine):
    """Kills the CE process once the first chunk's blocks have been posted (the prompt still prefilling)."""

    victim = None

    def pe_prepare_save_kvcache(self, scheduled, finished):
        super().pe_prepare_save_kvcache(scheduled, finished)
        if self.victim is not None and any(p.transfers for p in self._streams.values()):
            self.victim.kill()
            self.victim = None


def test_ce_killed_while_chunks_stream_frees_pe_blocks_and_reports_the_error(monkeypatch):

    monkeypatch.setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", True)
    ce = start_ce()
    pe = local_pe(KillsPeerMidStream, transfer_timeout_s=5.0, chunked_prefill=True, max_num_batched_tokens=24)
    free0 = pe.scheduler.block_manager.num_free_blocks
    prompt = list(range(1, 120))  # 5 chunks: the CE dies after the first chunk's write is posted
    pe.add_prefill("streamed", reserve(ce, "streamed", prompt, greedy(8)), greedy(8), prompt)
    pe.victim = ce
    started = time.monotonic()
    (r,) = run_pe(pe)
    assert time.monotonic() - started < 60
    assert not r.ok and r.error and not ce.alive
    assert pe.scheduler.block_manager.num_free_blocks == free0
    assert not pe.has_unfinished_requests() and not pe._streams


@pytest.fixture(scope="module")
def ce():
    proc = start_ce(pd=PDConfig(transfer_timeout_s=1.0, lease_grace_s=1.5))
    yield proc
    proc.close()


def test_refused_fingerprint_allocates_nothing_and_the_lease_frees_the_ce(ce):
    pe = local_pe()
    free0 = pe.scheduler.block_manager.num_free_blocks
    prompt = list(range(1, 40))
    target = reserve(ce, "foreign", prompt, greedy(4), lease_s=1.0)
    forged = dataclasses.replace(target, fingerprint="0" * 20, layout="SomeOtherModel bfloat16")
    with pytest.raises(KVTargetRejected, match="KV layout mismatch.*SomeOtherModel"):
        pe.add_prefill("foreign", forged, greedy(4), prompt)
    assert pe.scheduler.block_manager.num_free_blocks == free0 and not pe.requests
    out = wait_ce(ce, ["foreign"], timeout_s=30)["foreign"]
    assert out.outputs[0].finish_reason == "error" and "lease expired" in out.outputs[0].error
    assert wait_free_blocks(ce, N) == N
    assert ce.call("stats")["lease_expiries"] >= 1


def test_a_ce_of_another_layout_is_refused_at_registration(ce):
    pe = local_pe()
    forged = dataclasses.replace(ce.info["kv_region"], fingerprint="0" * 20, layout="SomeOtherModel bfloat16")
    with pytest.raises(KVTargetRejected, match="KV layout mismatch.*SomeOtherModel"):
        pe.connect_peer(ce.info["agent_name"], ce.info["agent_metadata"], forged)
    assert pe.agent.num_remote_lists == 0


def test_an_expired_reservation_is_refused_by_the_pe(ce):
    prompt = list(range(1, 20))
    target = reserve(ce, "slow", prompt, greedy(4), lease_s=0.3)
    out = wait_ce(ce, ["slow"], timeout_s=30)["slow"]
    assert "lease expired" in out.outputs[0].error
    pe = local_pe()
    with pytest.raises(KVTargetRejected, match="expired"):
        pe.add_prefill("slow", target, greedy(4), prompt)
    assert ce.call("stats")["reservations"] == 0
    assert wait_free_blocks(ce, N) == N  # quarantined blocks come back after the grace period


def test_lease_expiring_during_prefill_never_writes_and_releases_the_quarantine(ce):
    prompt = list(range(1, 30))
    pe = local_pe()
    target = reserve(ce, "late", prompt, greedy(4), lease_s=1.0)
    pe.add_prefill("late", target, greedy(4), prompt)
    time.sleep(1.2)  # the prefill is slower than the lease
    (r,) = run_pe(pe)
    assert not r.ok and "expired" in r.error
    out = wait_ce(ce, ["late"], timeout_s=30)["late"]
    assert out.outputs[0].finish_reason == "error"
    assert wait_free_blocks(ce, N, timeout_s=0.9) == N  # the PE's notice ends the quarantine early


def test_a_renewed_lease_keeps_a_prefill_slower_than_the_lease_and_the_pe_writes_within_it(ce):
    """Heartbeats: the CE extends the lease, then the PE is told the new end; the prefill, slower than
    the base lease, lands and decodes, and the PE's end never passes the CE's."""
    prompt = list(range(1, 30))
    pe = local_pe()
    target = reserve(ce, "renewed", prompt, greedy(4), lease_s=0.6)
    pe.add_prefill("renewed", target, greedy(4), prompt)
    first_end = target.expires_at
    for _ in range(6):  # 1.2 s: twice the base lease
        time.sleep(0.2)
        expires_at = ce.call("renew_reservation", "renewed", 0.6)
        assert expires_at > time.time() and pe.renew_target("renewed", expires_at)
    assert pe.targets["renewed"].expires_at == expires_at > first_end + 0.5
    (r,) = run_pe(pe)
    assert r.ok, r.error
    out = wait_ce(ce, ["renewed"], timeout_s=30)["renewed"]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert ce.call("renew_reservation", "renewed", 0.6) == 0.0  # handed off: nothing left to renew
    assert not pe.renew_target("renewed", time.time() + 10)
    assert wait_free_blocks(ce, N) == N


def test_a_fenced_reservation_whose_writer_is_gone_is_freed_within_a_second(ce):
    """The PE it was given is known dead (its process is gone): the fence of lease + grace is lifted."""
    target = reserve(ce, "orphan", [1, 2, 3], greedy(4), lease_s=30.0)
    ce.call("abort", "orphan")  # fenced: until the lease and its grace are over
    assert ce.call("stats")["quarantined"] == 1
    started = time.monotonic()
    ce.call("release_unused", "orphan")
    assert wait_free_blocks(ce, N, timeout_s=5) == N and ce.call("stats")["quarantined"] == 0
    assert time.monotonic() - started < 2.0 and len(target.block_ids) >= 1


def test_lease_expiring_between_chunks_stops_the_stream_and_releases_the_quarantine(ce, monkeypatch):
    monkeypatch.setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", True)
    prompt = list(range(1, 70))
    pe = local_pe(chunked_prefill=True, max_num_batched_tokens=24)
    free0 = pe.scheduler.block_manager.num_free_blocks
    writes, real = [], pe.agent.prepare_write
    monkeypatch.setattr(pe.agent, "prepare_write", lambda *a, **kw: writes.append(a) or real(*a, **kw))
    pe.add_prefill("late-chunks", reserve(ce, "late-chunks", prompt, greedy(4), lease_s=1.0), greedy(4), prompt)
    pe.step()  # the first chunk; its blocks would go out with the next step
    time.sleep(1.2)  # the lease ends before they do
    (r,) = run_pe(pe)
    assert not r.ok and "expired" in r.error and writes == []  # nothing written after the deadline
    assert pe.scheduler.block_manager.num_free_blocks == free0
    out = wait_ce(ce, ["late-chunks"], timeout_s=30)["late-chunks"]
    assert out.outputs[0].finish_reason == "error"
    assert wait_free_blocks(ce, N, timeout_s=0.9) == N  # the PE's notice ends the quarantine early


@pytest.mark.parametrize("pe_thread", ["1", "0"])
def test_abort_on_the_pe_releases_the_ce_reservation(ce, monkeypatch, pe_thread):
    """The PE's notice reaches the CE also when no progress thread sends it: then the PE's loop
    turns (`poll_handoffs`) drive it out, here on a connection no transfer has used yet."""
    monkeypatch.setattr(envs, "DEEPINFER_NIXL_PROGRESS_THREAD", pe_thread)
    pe = local_pe()
    assert pe.agent.progress_thread is (pe_thread == "1")
    target = reserve(ce, "gone", [1, 2, 3, 4], greedy(4))
    pe.add_prefill("gone", target, greedy(4), [1, 2, 3, 4])
    ce.call("abort", "gone")
    pe.abort_request("gone")
    assert not pe.has_unfinished_requests()
    deadline = time.monotonic() + 0.9
    while ce.call("stats")["free_blocks"] != N and time.monotonic() < deadline:
        pe.poll_handoffs()  # an idle PE's engine loop turn
        time.sleep(0.01)
    assert ce.call("stats")["free_blocks"] == N


def test_reservation_over_capacity_is_refused_clearly(ce):
    prompt = list(range(1, 250))  # 32 blocks of 8 for prompt + 1
    fits = N // 32
    for i in range(fits):
        reserve(ce, f"fill-{i}", prompt, greedy(4))
    with pytest.raises(RemoteError, match="^CapacityError: .*free KV blocks"):
        reserve(ce, "one-too-many", prompt, greedy(4))
    for i in range(fits):
        ce.call("release_unused", f"fill-{i}")  # no PE was given these targets: no fence needed
    assert wait_free_blocks(ce, N) == N and ce.call("stats")["requests"] == 0


def test_an_aborted_reservation_stays_fenced_until_its_lease_and_grace_are_over(ce):
    """A PE may post writes until the target's lease ends: an abort alone frees the blocks no sooner
    than lease + grace (here 3 s + 1.5 s), not grace after the abort."""
    target = reserve(ce, "fenced", [1, 2, 3], greedy(4), lease_s=3.0)
    ce.call("abort", "fenced")
    time.sleep(2.0)  # past the grace after the abort, inside the lease
    stats = ce.call("stats")
    assert stats["quarantined"] == 1 and stats["free_blocks"] == N - len(target.block_ids)
    assert wait_free_blocks(ce, N, timeout_s=10) == N and ce.call("stats")["quarantined"] == 0


def test_bad_target_size_is_refused(ce):
    pe = local_pe()
    target = reserve(ce, "short", [1, 2, 3], greedy(2))
    with pytest.raises(KVTargetRejected, match="reserves"):
        pe.add_prefill("short", target, greedy(2), list(range(1, 60)))
    assert not pe.requests
    ce.call("release_unused", "short")  # the PE refused it (as the router learns): nothing can land
    assert wait_free_blocks(ce, N) == N


def test_fingerprint_covers_the_language_model_inside_a_multimodal_config():
    import torch

    from deepinfer_core.transfer.layout import KVLayout

    buf = torch.zeros(2, 4, 8, 16)
    base = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {"hidden_size": 128, "kv_lora_rank": 32}}
    other = {**base, "text_config": {"hidden_size": 128, "kv_lora_rank": 64}}
    assert KVLayout.of(base, buf, 8).fingerprint != KVLayout.of(other, buf, 8).fingerprint
    assert KVLayout.of(base, buf, 8).fingerprint == KVLayout.of(dict(base), buf, 8).fingerprint


def test_a_forward_that_fails_after_the_requests_were_made_releases_them(ce, monkeypatch):
    """A PE makes its hand-off writes' requests before the forward is known to be done: if the
    forward then fails, the requests go back to NIXL instead of staying with the agent."""
    pe = local_pe()
    discarded, real = [], pe.agent.discard
    monkeypatch.setattr(pe.agent, "discard", lambda write: discarded.append(write.handle is not None) or real(write))

    def device_lost():
        raise RuntimeError("device lost")

    monkeypatch.setattr(pe.worker.runner, "wait_forward", device_lost)
    prompt = list(range(1, 20))
    pe.add_prefill("lost", reserve(ce, "lost", prompt, greedy(4)), greedy(4), prompt)
    with pytest.raises(RuntimeError, match="device lost"):
        pe.step()
    assert discarded == [True]  # the one prepared write, released unposted
