"""`python -m benchmarks.kernel_bench --engine`: a whole decode step and a prefill of the engine, end to end.

    python -m benchmarks.kernel_bench --engine [--preset qwen3-30b-a3b|tiny] [--layers N] [--batch 64]
        [--context 4096] [--prefill-tokens 8192] [--new-tokens 32] [--profile-steps 20] [--zos both|on|off]
        [--no-hf] [--cpu] [--json F]

The model is a random-weight checkpoint of the preset's dimensions (Qwen3-30B-A3B: hidden 2048, 48
layers, 32 query / 4 KV heads of 128, 128 experts top-8 of width 768, vocab 151936, RoPE theta 1e6,
q/k-norm, untied embeddings), run through the normal engine (`LLMEngine` from `EngineArgs`) out of a
temporary directory holding only config.json and the tokenizer: `load_format="dummy"` draws the
weights on the device (normal(0, 0.02), seeded) instead of writing 61 GB of safetensors. One engine
is built per zero-overhead-scheduling setting (`DEEPINFER_ZERO_OVERHEAD_SCHEDULING` is set before
the engine is made and kept while it runs), each with decode CUDA graphs as the engine captures them.

What is measured, per engine:

- **decode step**: `batch` prompts of `context` random tokens are added at once and the engine is
  stepped; once every sequence has its first token, each step that adds one token to every sequence
  is a decode step, and its time is the wall-clock interval between two `engine.step()` returns (the
  step synchronises on its sampled tokens, so this is the step's real period, host work included).
  The median is taken after `WARMUP_STEPS` decode steps.
- **generate**: the wall time from adding the requests until every sequence has `new_tokens`
  tokens: the same quantity `LLM.generate` would take for `max_tokens=new_tokens`, prefill included.
  `transformers` runs `generate` (greedy, the same prompts, `new_tokens` new tokens) on the *same
  tensors*: its model is built on the meta device and its parameters are assigned views of the
  engine model's weights (no second copy), timed by `benchmarks.model_throughput.run_hf`.
  ratio = engine tokens/s / transformers tokens/s.
- **GPU idle between steps** (CUDA only): `torch.profiler` with CUDA activity alone over
  `--profile-steps` decode steps (after 2 profiler warm-up steps); every kernel, memcpy and memset
  interval from the trace, on any stream, is merged; idle = (span - busy) / steps, where span runs
  from the first start to the last end. It counts every gap, the one between two steps and those
  inside a step (host-launched sampling, input copies). CUPTI adds a few µs to each host-side launch,
  so both settings read a little high; they are measured the same way.
- **gap between steps** (CUDA only, no profiler): CUDA events recorded on the stream at the start
  of each step's launch and after its sampling is queued; `gap` = the stream's time from one step's
  end event to the next step's start event (~0 when the next step was already queued: the host's
  work hidden, which is what zero-overhead scheduling is for), `GPU ms` = start to end of a step.
- **bytes per decode step**: weights read + KV read. Weights: every parameter except the routed
  experts and the token embedding in full (attention, norms, routers, lm_head), the embedding rows of
  the `batch` tokens, and of each MoE layer's experts only those the step's routing selected: one
  decode step is run eagerly (its CUDA graphs set aside) with a forward pre-hook on every
  `SparseMoeBlock` that recomputes its routing (`select_experts` on the block's own router) and counts
  the distinct experts, which is assumed for every measured step. KV: batch × tokens attended per
  sequence (context + tokens generated so far, averaged over the measured steps) × per-token K/V bytes
  of all layers. bandwidth utilization = bytes / step time / copy bandwidth, the copy bandwidth
  (bytes read + written by a device-to-device copy) measured at the start as the kernel table's
  ceilings are (`timing.ceilings`).
- **prefill** (first engine only): one prompt of `--prefill-tokens` tokens, `max_tokens=1`, from
  adding it to its output; median of `PREFILL_REPS` after one warm-up. TFLOP/s counts 2 × active weights per token
  (attention, router, top-k experts) plus causal attention (4 × heads × head_dim × visible pairs).

On CPU (`--preset tiny`) every time is wall clock; the profiler columns read n/a.
Memory: only one model's weights are ever resident (the engines are built one after the other and
transformers borrows the last engine's tensors after its KV cache and graphs are freed); the peak
allocated memory of each phase is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Optional

import torch
from torch import nn

from benchmarks.kernel_bench.engine_build import build_engine, generate_all, random_prompts, write_model_dir
from benchmarks.kernel_bench.engine_env import Log, free_memory, measure_ceilings, peak_gib, reset_peak, zos_env
from benchmarks.kernel_bench.engine_gpu_time import measure_gaps, measure_idle
from benchmarks.kernel_bench.engine_report import fmt_size, format_report
from benchmarks.kernel_bench.engine_spec import PREFILL_REPS, PRESETS, Spec, spec_from_args
from benchmarks.kernel_bench.engine_steps import DecodeRun, finish, run_decode, run_prefill
from benchmarks.kernel_bench.engine_traffic import count_routed_experts, model_bytes, prefill_flops, step_weight_bytes
from benchmarks.kernel_bench.engine_transformers import hf_model_sharing


class EngineBench:
    """One run: its phases fill `res` in place, so what finished stays there if a later phase raises."""

    def __init__(self, spec: Spec, log: Log, on_update: Optional[Callable[[dict], None]], res: dict[str, Any]):
        self.spec, self.log, self.on_update, self.res = spec, log, on_update, res
        self.prompts: list[list[int]] = []
        self.prefill_prompt: list[int] = []

    def update(self) -> None:
        if self.on_update is not None:
            self.on_update(self.res)

    def measure(self) -> None:
        spec, res = self.spec, self.res
        res.update(self._header())
        self.log(f"preset {spec.preset}, {spec.layers}/{res['layers_full']} layers, batch {spec.batch}, "
                 f"context {spec.context}, prefill {spec.prefill_tokens}, new tokens {spec.new_tokens}, "
                 f"device {spec.device}")  # fmt: skip
        res["ceilings"] = c = measure_ceilings(spec.device)
        self.log(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, matmul {c['matmul_TFLOPs']:.1f} TFLOP/s ({c['timer']})")
        self.update()
        vocab = spec.hf_config["vocab_size"]
        self.prompts = random_prompts(spec.batch, spec.context, vocab, seed=1)
        self.prefill_prompt = random_prompts(1, spec.prefill_tokens, vocab, seed=2)[0]
        with tempfile.TemporaryDirectory() as path:
            write_model_dir(path, spec.hf_config)
            shared_model = None
            for i, zos in enumerate(spec.zos):
                shared_model = self._engine_phase(path, i, zos)
            if shared_model is not None:
                reset_peak(spec.device)
                self._transformers_phase(shared_model)
                shared_model = None
                free_memory(spec.device)
                self.update()

    def _header(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "preset": spec.preset,
            "layers": spec.layers,
            "layers_full": PRESETS[spec.preset]["num_hidden_layers"],
            "batch": spec.batch,
            "context": spec.context,
            "prefill_tokens": spec.prefill_tokens,
            "new_tokens": spec.new_tokens,
            "dtype": "bfloat16" if spec.cuda else "float32",
            "decode": [],
            "peak_gib": {},
        }

    def _engine_phase(self, path: str, i: int, zos: bool) -> Optional[nn.Module]:
        """Build the engine for one ZOS setting and measure it; its model is returned (to lend its
        tensors to transformers) only by the last engine, when transformers runs."""
        spec, tag = self.spec, f"ZOS {'on' if zos else 'off'}"
        reset_peak(spec.device)
        with zos_env(zos):
            self.log(f"{tag}: building the engine (dummy weights, {'CUDA graphs' if spec.cuda else 'eager'})")
            engine = build_engine(path, spec)
            if i == 0:
                self._prefill_phase(engine, zos, tag)
            self.log(f"{tag}: warm-up generate (2 x {spec.context} tokens)")
            generate_all(engine, self.prompts[:2], 3, f"warm{i}")
            self._decode_phase(engine, zos, tag)
            kept = engine.worker.model if i == len(spec.zos) - 1 and spec.hf else None
            del engine
            free_memory(spec.device)
        return kept

    def _prefill_phase(self, engine, zos: bool, tag: str) -> None:
        """The model's byte counts, then the timed prefill (first engine only)."""
        spec, res = self.spec, self.res
        res["model_bytes"] = mb = model_bytes(engine.worker.model)
        self.log(f"{tag}: weights {fmt_size(mb['total'])}, KV {fmt_size(mb['kv_per_token'])}/token")
        self.log(f"{tag}: prefill {spec.prefill_tokens} tokens x {1 + PREFILL_REPS} (first is warm-up)")
        times = run_prefill(engine, self.prefill_prompt, PREFILL_REPS)
        t = statistics.median(times)
        flops = prefill_flops(mb, spec.hf_config, spec.prefill_tokens)
        res["prefill"] = {
            "zos": zos,
            "tokens": spec.prefill_tokens,
            "ms": [x * 1e3 for x in times],
            "ms_median": t * 1e3,
            "tok_s": spec.prefill_tokens / t,
            "tflops": flops / t / 1e12,
            "mfu": flops / t / (res["ceilings"]["matmul_TFLOPs"] * 1e12),
        }
        self.log(f"{tag}: prefill {t * 1e3:.1f} ms = {spec.prefill_tokens / t:,.0f} tok/s")
        self.update()

    def _decode_phase(self, engine, zos: bool, tag: str) -> None:
        spec = self.spec
        self.log(f"{tag}: decode batch {spec.batch} x {spec.context} tokens, {spec.new_tokens} new")
        run, ids = run_decode(engine, self.prompts, spec)
        row = self._decode_row(run, zos)
        self.log(f"{tag}: decode step {row['step_ms_median']:.2f} ms (median of {len(run.step_s)}), "
                 f"generate {run.e2e_s:.2f} s")  # fmt: skip
        if spec.cuda:
            row.update(measure_gaps(engine, spec.gap_steps))
            self.log(f"{tag}: events: GPU {row['gpu_ms_per_step']:.2f} ms/step, "
                     f"gap between steps {row['gap_us_per_step']:.0f} µs")  # fmt: skip
        if spec.cuda and spec.profile_steps > 0:
            self._profile_idle(engine, row, tag)
        if "unique_experts" not in self.res:
            self._count_experts(engine, tag)
        finish(engine, ids)
        self._add_traffic(row, tag)

    def _decode_row(self, run: DecodeRun, zos: bool) -> dict[str, Any]:
        step = statistics.median(run.step_s)
        return {
            "zos": zos,
            "step_ms_median": step * 1e3,
            "step_ms": [x * 1e3 for x in run.step_s],
            "attended_mean": statistics.fmean(run.attended),
            "decode_tok_s": self.spec.batch / step,
            "e2e_s": run.e2e_s,
            "gen_tok_s": self.spec.batch * self.spec.new_tokens / run.e2e_s,
            "idle_us_per_step": None,
            "busy_frac": None,
            "gpu_ms_per_step": None,
            "gap_us_per_step": None,
        }

    def _profile_idle(self, engine, row: dict[str, Any], tag: str) -> None:
        self.log(f"{tag}: profiling {self.spec.profile_steps} decode steps (CUDA activity only)")
        try:
            row.update(measure_idle(engine, self.spec.profile_steps))
            if row["idle_us_per_step"] is not None:
                self.log(f"{tag}: GPU idle {row['idle_us_per_step']:.0f} µs/step, busy {row['busy_frac']:.1%}")
            else:
                self.log(f"{tag}: the trace held no kernel events: idle n/a")
        except Exception as exc:  # a profiler that will not start must not cost the rest
            self.log(f"{tag}: profiler failed ({type(exc).__name__}: {str(exc)[:200]}): idle n/a")

    def _count_experts(self, engine, tag: str) -> None:
        """Experts the decode batch routes to, per MoE layer (once: the first engine's count serves all)."""
        res = self.res
        self.log(f"{tag}: one eager decode step to count the routed experts")
        unique = count_routed_experts(engine, self.spec.batch)
        res["routing"] = "measured (eager step, hooks on the MoE blocks)"
        if unique is None:
            unique = list(res["model_bytes"]["num_experts"])
            res["routing"] = "upper bound: every expert (no eager decode forward was seen)"
        res["unique_experts"] = unique
        res["step_weight_bytes"] = step_weight_bytes(res["model_bytes"], unique, self.spec.batch)
        touched = "n/a (no MoE layers)"
        if unique:
            touched = f"{statistics.fmean(unique):.1f}/{res['model_bytes']['num_experts'][0]}"
        self.log(f"{tag}: experts touched per layer {touched}, "
                 f"weights read {fmt_size(res['step_weight_bytes'])}/step")  # fmt: skip

    def _add_traffic(self, row: dict[str, Any], tag: str) -> None:
        """Bytes per decode step and what they make of the step time, then the row joins the results."""
        res, step = self.res, row["step_ms_median"] / 1e3
        row["kv_bytes"] = self.spec.batch * row["attended_mean"] * res["model_bytes"]["kv_per_token"]
        row["bytes"] = res["step_weight_bytes"] + row["kv_bytes"]
        row["gbps"] = row["bytes"] / step / 1e9
        row["bw_util"] = row["bytes"] / step / (res["ceilings"]["copy_GBps"] * 1e9)
        row["peak_gib"] = res["peak_gib"][f"engine {tag}"] = peak_gib(self.spec.device)
        res["decode"].append(row)
        self.log(f"{tag}: {fmt_size(row['bytes'])}/step -> {row['gbps']:.4g} GB/s = "
                 f"{row['bw_util']:.1%} of copy bandwidth")  # fmt: skip
        self.update()

    def _transformers_phase(self, model: nn.Module) -> None:
        spec, res = self.spec, self.res
        self.log(f"transformers: generate, batch {spec.batch} x {spec.context} tokens, on the same tensors")
        try:
            from benchmarks.model_throughput import run_hf

            hf = hf_model_sharing(model, spec.hf_config, spec.device)
            dtype = torch.bfloat16 if spec.cuda else torch.float32
            hf_s = run_hf(hf, self.prompts, None, spec.new_tokens, spec.device, dtype)
        except Exception as exc:  # e.g. out of memory: the engine's numbers stand without it
            res["transformers_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            self.log(f"transformers failed: {res['transformers_error']}")
            return
        res["transformers"] = {"e2e_s": hf_s, "gen_tok_s": spec.batch * spec.new_tokens / hf_s}
        res["peak_gib"]["transformers"] = peak_gib(spec.device)
        for row in res["decode"]:
            row["ratio_vs_hf"] = row["gen_tok_s"] / res["transformers"]["gen_tok_s"]
        self.log(f"transformers: generate {hf_s:.2f} s")


def run_engine_bench(
    spec: Spec,
    log: Optional[Log] = None,
    on_update: Optional[Callable[[dict], None]] = None,
    res: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Measure everything the module docstring lists into `res` (a new dict when None) and return it.
    `on_update(res)` runs after each phase, and `res` holds every finished phase if a later one
    raises, so a cut-short run still leaves its numbers."""
    bench = EngineBench(spec, log or Log(), on_update, {} if res is None else res)
    bench.measure()
    return bench.res


def main(args: argparse.Namespace) -> int:
    """`--engine`: run, write the JSON after every phase (`--json`), print the tables of what finished."""
    spec = spec_from_args(args)

    def dump(res: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**res, "spec": asdict(spec)}, f, indent=1)

    res: dict[str, Any] = {}
    rc = 0
    try:
        run_engine_bench(spec, Log(), dump, res)
    except Exception:  # report what was measured before the failure, then fail
        traceback.print_exc()
        rc = 1
    if "ceilings" in res:
        print()
        print(format_report(res), flush=True)
    return rc
