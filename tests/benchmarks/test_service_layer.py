"""The service-layer benchmark's instrument: the token source on its own and behind the real
worker cores and router, the exactness check, and the benchmark's smallest run end to end
(real head, worker and client processes on 127.0.0.1), whose every delivered token must be
the one the token source emitted."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.service_layer_analysis import Emissions, verify
from benchmarks.service_layer_pd_source import TokenSourceCompletion, TokenSourcePrompt
from benchmarks.token_source import WORDS, TokenSourceEngine, expected_tokens, ids_of_text
from deepinfer_core.errors import InvalidRequestError
from deepinfer_core.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _drain(engine, limit: int = 1000) -> list:
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the token source did not finish")


def test_the_token_source_reports_cumulative_outputs_and_ends_at_max_tokens():
    engine = TokenSourceEngine(step_period_s=0.0, tokens_per_step=2)
    engine.add_request("a", params=SamplingParams(max_tokens=5), prompt_token_ids=[9, 1, 2])
    outputs = _drain(engine)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 4, 5]
    last = outputs[-1].outputs[0]
    assert last.token_ids == expected_tokens([9], 5) == [9, 10, 11, 12, 13]
    assert last.text == "".join(WORDS[t] for t in last.token_ids) and ids_of_text(last.text) == last.token_ids
    assert last.finish_reason == "length" and outputs[-1].finished and not outputs[0].finished
    assert outputs[0].outputs[0].token_ids is not last.token_ids  # fresh lists, as the engine reports
    assert len(engine.take_emissions()["a"]) == 5 and engine.requests == {} and engine.num_tokens == 5


def test_the_token_source_keeps_its_step_period_and_batch():
    engine = TokenSourceEngine(step_period_s=0.01, max_batch=2)
    for i in range(3):
        engine.add_request(f"r{i}", params=SamplingParams(max_tokens=2), prompt_token_ids=[i + 1])
    start = time.monotonic()
    counts = [len(engine.step()) for _ in range(4)]
    assert counts == [2, 2, 1, 1]  # the third request waits for room, in admission order
    assert time.monotonic() - start >= 0.03
    assert engine.load().requests == 0 and not engine.has_unfinished_requests()


def test_the_token_source_refuses_like_an_engine_and_aborts():
    engine = TokenSourceEngine(step_period_s=0.0)
    engine.add_request("a", prompt_token_ids=[1])
    with pytest.raises(InvalidRequestError):
        engine.add_request("a", prompt_token_ids=[1])
    with pytest.raises(InvalidRequestError):
        engine.add_request("b", params=SamplingParams(n=2), prompt_token_ids=[1])
    engine.step()
    engine.abort_request("a")
    assert engine.step() == [] and engine.requests == {}
    assert len(engine.take_emissions()["a"]) == 1


def test_the_prefill_and_decode_stand_ins_hand_off_through_the_real_cores_and_router():
    from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo
    from services.router.clients import LocalWorkerClient
    from services.router.config import RouterConfig
    from services.router.core import RouterCore
    from services.router.registry import PoolRegistry
    from services.workers.decode_core import DecodeCore
    from services.workers.prefill_core import PrefillCore

    async def run():
        pe = PrefillCore(TokenSourcePrompt(step_period_s=0.001), "pe-0")
        ce = DecodeCore(TokenSourceCompletion(step_period_s=0.001, handoff_delay_s=0.002), "ce-0")
        cores = {"pe-0": pe, "ce-0": ce}
        registry = PoolRegistry(lambda info: LocalWorkerClient(cores[info.worker_id]))
        for core in cores.values():
            core.start()
        try:
            for wid, pool in (("pe-0", POOL_PREFILL), ("ce-0", POOL_DECODE)):
                config = cores[wid].engine.config
                info = WorkerInfo(wid, pool, config.engine_type.value, "local", max_model_len=4096)
                info.block_size, info.num_blocks = config.cache.block_size, config.cache.num_gpu_blocks
                info.max_num_seqs = config.scheduler.max_num_seqs
                await registry.add(info)
            router = RouterCore(registry, RouterConfig(pools=(POOL_PREFILL, POOL_DECODE)))
            tokens, text, finish = [], "", None
            async for delta in router.generate("r", [42, 1, 2], SamplingParams(max_tokens=6)):
                assert delta.token_offset == len(tokens)
                tokens += delta.token_ids
                text += delta.text
                finish = delta.finish_reason or finish
            return tokens, text, finish
        finally:
            for core in cores.values():
                core.stop()

    tokens, text, finish = asyncio.run(asyncio.wait_for(run(), 30))
    assert tokens == expected_tokens([42], 6) and ids_of_text(text) == tokens and finish == "length"


def _record(seed, tokens, finish=None, rid="g1", in_order=True):
    recv = [0.0] * len(tokens)
    return dict(
        slot=0, seed=seed, request_id=rid, tokens=tokens, recv=recv, finish_reason=finish, error=None, in_order=in_order
    )


def test_the_check_catches_a_lost_a_doubled_and_a_swapped_token():
    emissions = Emissions()
    emissions.add("w0", {"g1-0/0": [0.0] * 4})
    good = expected_tokens([3], 4)
    assert verify([_record(3, good, "length")], emissions, 4)["mismatches"] == 0
    assert verify([_record(3, good[:2])], emissions, 4)["mismatches"] == 0  # cut off at the end of a run
    for bad in (good[:1] + good[2:], good[:2] + good[1:2] + good[2:3], [good[1], good[0]] + good[2:]):
        assert verify([_record(3, bad, "length" if len(bad) == 4 else None)], emissions, 4)["mismatches"] > 0
    assert verify([_record(3, good[:3], "length")], emissions, 4)["mismatches"] > 0  # finished short
    assert verify([_record(3, good, None, rid="g2")], emissions, 4)["mismatches"] > 0  # nobody emitted it


def test_the_smallest_run_delivers_exactly_what_the_sources_emitted(tmp_path):
    """2 streams, 1 worker, SSE and gRPC, a second per level: sane numbers, every token exact."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.service_layer", "--quick", "--streams", "2", "--workers", "1"]
    cmd += ["--clients", "1", "--max-tokens", "8", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the benchmark and every process it started
            proc.wait(10)
    assert proc.returncode == 0, log
    result = json.loads(out.read_text())
    assert [(lv["protocol"], lv["streams"]) for lv in result["levels"]] == [("sse", 2), ("grpc", 2)]
    for lv in result["levels"]:
        check = lv["check"]
        assert check["mismatches"] == 0 and check["errors"] == 0, check
        assert check["finished"] >= 4 and check["tokens"] >= 32, check
        assert lv["ramped"] and lv["drained"]
        # 2 streams of 1 token per 20 ms step: about 100 tokens/s, emitted and delivered
        assert 40 < lv["emitted_tokens_per_s"] < 110 and 40 < lv["delivered_tokens_per_s"] < 110, lv
        assert 0 < lv["latency_p50_ms"] <= lv["latency_p99_ms"] < 1000
        assert all(lv["cpu_us_per_token"][name] > 0 for name in ("head", "w0", "clients"))
    overhead = result["overhead"]
    assert overhead["text_exact"] and overhead["served_ms"] > overhead["in_process_ms"] > 0


def test_the_router_assembly_benchmark_runs_what_the_router_runs(monkeypatch):
    """`benchmarks/router_assembly.py` times `SampleProgress.place` then `SampleAssembler.push`; the
    deltas it feeds come out whole (with a holdback, all but the held characters)."""
    from benchmarks import router_assembly
    from services.common.deltas import SampleAssembler

    pushed: list = []
    real = SampleAssembler.push
    monkeypatch.setattr(SampleAssembler, "push", lambda self, d: pushed.append(real(self, d)) or pushed[-1])
    assert router_assembly.us_per_token(50, holdback=4) > 0
    assert len(pushed) == 50 and "".join(d.text for d in pushed) == ("abc " * 50)[:-4]
