"""`python -m benchmarks.kernel_bench --engine` on CPU: the tiny preset end to end, its numbers checked against
the measured values they are made of and the bytes per decode step against a hand count."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.kernel_bench import cli, engine_build, engine_env, engine_gpu_time, engine_spec, engine_transformers
from benchmarks.kernel_bench.engine_spec import PRESETS

BATCH, CONTEXT, PREFILL, NEW = 2, 16, 32, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    argv = ["--engine", "--preset", "tiny", "--cpu", "--batch", str(BATCH), "--context", str(CONTEXT),
            "--prefill-tokens", str(PREFILL), "--new-tokens", str(NEW), "--json", str(out)]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(argv) == 0
    return json.loads(out.read_text()), printed.getvalue()


def hand_counted_step_weights(unique: list[int]) -> int:
    """Bytes of weights one decode step of the tiny preset reads (fp32 on CPU), counted by hand."""
    c = PRESETS["tiny"]
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, inter = c["num_experts"], c["moe_intermediate_size"]
    attention = H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 2 * D  # q, k, v, o projections, q/k norms
    per_layer = attention + 2 * H + E * H  # + the two layer norms + the router
    dense = L * per_layer + H + V * H  # + final norm + lm_head
    assert dense == 58752  # 2 x (12288 + 32 + 128 + 512) + 64 + 32768
    per_expert = 3 * H * inter  # gate, up, down
    params = dense + BATCH * H + sum(u * per_expert for u in unique)  # + the batch's embedding rows
    return 4 * params


def test_engine_mode_runs_tiny_on_cpu(run) -> None:
    res, printed = run
    assert res["preset"] == "tiny" and res["layers"] == res["layers_full"] == 2
    assert "| ZOS | decode step ms |" in printed and "| prefill tokens (ZOS on) |" in printed
    assert "n/a" in printed  # no profiler columns on CPU
    assert "2/2 layers" in printed
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_TFLOPs"] > 0
    assert [r["zos"] for r in res["decode"]] == [True, False]
    assert "transformers" in res and res["transformers"]["e2e_s"] > 0


def test_decode_numbers_follow_from_the_measurements(run) -> None:
    res, _ = run
    bw = res["ceilings"]["copy_GBps"] * 1e9
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    assert res["model_bytes"]["kv_per_token"] == kv_per_token
    unique = res["unique_experts"]
    top_k, experts = PRESETS["tiny"]["num_experts_per_tok"], PRESETS["tiny"]["num_experts"]
    assert len(unique) == 2 and all(top_k <= u <= min(experts, BATCH * top_k) for u in unique)
    assert res["routing"].startswith("measured")
    assert res["step_weight_bytes"] == hand_counted_step_weights(unique)
    hf_tok_s = res["transformers"]["gen_tok_s"]
    assert hf_tok_s == pytest.approx(BATCH * NEW / res["transformers"]["e2e_s"])
    for r in res["decode"]:
        step = r["step_ms_median"] / 1e3
        assert step > 0 and len(r["step_ms"]) >= engine_spec.MIN_DECODE_STEPS
        assert r["step_ms_median"] == pytest.approx(statistics.median(r["step_ms"]))
        assert r["decode_tok_s"] == pytest.approx(BATCH / step)
        assert CONTEXT + 1 <= r["attended_mean"] < CONTEXT + 40
        assert r["kv_bytes"] == pytest.approx(BATCH * r["attended_mean"] * kv_per_token)
        assert r["bytes"] == pytest.approx(hand_counted_step_weights(unique) + r["kv_bytes"])
        assert r["gbps"] == pytest.approx(r["bytes"] / step / 1e9)
        assert r["bw_util"] == pytest.approx(r["bytes"] / step / bw)
        assert r["e2e_s"] > 0 and r["gen_tok_s"] == pytest.approx(BATCH * NEW / r["e2e_s"])
        assert r["ratio_vs_hf"] == pytest.approx(r["gen_tok_s"] / hf_tok_s)
        assert r["idle_us_per_step"] is None and r["busy_frac"] is None and r["peak_gib"] is None


def test_prefill_numbers_follow_from_the_measurements(run) -> None:
    res, _ = run
    p = res["prefill"]
    assert p["tokens"] == PREFILL and len(p["ms"]) == engine_spec.PREFILL_REPS
    assert p["ms_median"] == pytest.approx(statistics.median(p["ms"])) and p["ms_median"] > 0
    assert p["tok_s"] == pytest.approx(PREFILL / (p["ms_median"] / 1e3))
    assert p["mfu"] == pytest.approx(p["tflops"] / res["ceilings"]["matmul_TFLOPs"])
    assert p["tflops"] > 0


def test_layers_and_preset_defaults_reach_the_spec() -> None:
    args = argparse.Namespace(preset="qwen3-30b-a3b", layers=4, batch=None, context=None, prefill_tokens=None,
                              new_tokens=None, profile_steps=None, zos="on", no_hf=True, cpu=True)  # fmt: skip
    spec = engine_spec.spec_from_args(args)
    assert spec.hf_config["num_hidden_layers"] == 4 and spec.hf_config["num_experts"] == 128
    assert (spec.batch, spec.context, spec.prefill_tokens, spec.new_tokens) == (64, 4096, 8192, 32)
    assert spec.zos == (True,) and not spec.hf


def test_zos_env_is_set_inside_and_restored_after(monkeypatch) -> None:
    from deepinfer_core import envs

    monkeypatch.setenv(engine_spec.ZOS_ENV, "1")
    with engine_env.zos_env(False):
        assert not envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING
    assert envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING


def test_idle_is_span_minus_the_union_of_gpu_intervals() -> None:
    trace = [
        {"ph": "X", "cat": "kernel", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 5.0, "dur": 10.0},  # overlaps: union [0, 15)
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20.0, "dur": 5.0},
        {"ph": "X", "cat": "cpu_op", "ts": 15.0, "dur": 100.0},  # host work: not GPU time
        {"ph": "X", "cat": "gpu_memset", "ts": 40.0, "dur": 10.0},
    ]
    span, busy = engine_gpu_time.merge_busy(engine_gpu_time.gpu_intervals(trace))
    assert (span, busy) == (50.0, 30.0)
    assert engine_gpu_time.merge_busy([]) == (0.0, 0.0)


def test_profiler_plumbing_runs_on_cpu() -> None:
    """The profiler schedule, trace export and parsing, with CPU activity (no kernels: idle n/a)."""
    from torch.profiler import ProfilerActivity

    class Stepper:
        calls = 0

        def step(self) -> list:
            Stepper.calls += 1
            torch.randn(64, 64) @ torch.randn(64, 64)
            return []

    out = engine_gpu_time.measure_idle(Stepper(), 3, activities=[ProfilerActivity.CPU])
    assert Stepper.calls == 3 + engine_spec.PROFILER_WARMUP
    assert out["idle_us_per_step"] is None and out["kernels"] == 0


def test_transformers_model_shares_the_engine_tensors(tmp_path: Path) -> None:
    """transformers runs on the engine model's own storage and greedy-decodes the same tokens."""
    args = argparse.Namespace(preset="tiny", layers=None, batch=2, context=12, prefill_tokens=16, new_tokens=6,
                              profile_steps=None, zos="off", no_hf=False, cpu=True)  # fmt: skip
    spec = engine_spec.spec_from_args(args)
    engine_build.write_model_dir(str(tmp_path), spec.hf_config)
    engine = engine_build.build_engine(str(tmp_path), spec)
    prompts = engine_build.random_prompts(2, 12, PRESETS["tiny"]["vocab_size"], seed=3)
    ours = engine_build.generate_all(engine, prompts, 6, "t")
    model = engine.worker.model
    hf = engine_transformers.hf_model_sharing(model, spec.hf_config, "cpu")
    hf_w13 = hf.model.layers[0].mlp.experts.gate_up_proj
    assert hf_w13.data_ptr() == model.model.layers[0].mlp.experts.w13_weight.data_ptr()
    assert hf.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor(prompts), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out[:, 12:].tolist() == ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_mode_on_gpu_profiles_idle_time(tmp_path: Path) -> None:
    """The CUDA-only parts (decode graphs, the profiler's idle time, the eager routing step, peak
    memory) on the tiny preset: a quick check before the full-size run."""
    out = tmp_path / "engine.json"
    argv = ["--engine", "--preset", "tiny", "--batch", "4", "--context", "32", "--prefill-tokens", "64",
            "--new-tokens", "6", "--profile-steps", "4", "--json", str(out)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["dtype"] == "bfloat16" and res["routing"].startswith("measured")
    for r in res["decode"]:
        assert r["kernels"] > 0 and r["profiled_steps"] == 4
        assert r["idle_us_per_step"] >= 0 and 0 < r["busy_frac"] <= 1
        assert r["peak_gib"] > 0 and r["ratio_vs_hf"] > 0
