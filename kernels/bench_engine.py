"""`python -m kernels.bench --engine`: a whole decode step and a prefill of the engine, end to end.

    python -m kernels.bench --engine [--preset qwen3-30b-a3b|tiny] [--layers N] [--batch 64]
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
  engine model's weights (no second copy), timed by `benchmarks/model_throughput.run_hf`.
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
  (bytes read + written by a device-to-device copy) measured at the start as `kernels.bench` does.
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
import contextlib
import gc
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

ZOS_ENV = "DEEPINFER_ZERO_OVERHEAD_SCHEDULING"
WARMUP_STEPS = 3  # decode steps left out of the median
MIN_DECODE_STEPS = 4  # measured decode steps, at least (the run goes past new_tokens if it must)
PREFILL_REPS = 3
PROFILER_WARMUP = 2
STD = 0.02
SEED = 0

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_act="silu",
    attention_bias=False,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    initializer_range=STD,
)
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B's config.json, the architecture fields
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=151936,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # the same architecture at toy sizes (2 * moe_intermediate != hidden: a transposed expert layout shows)
    "tiny": dict(
        _QWEN3_MOE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}
# per preset: batch, context, prefill tokens, new tokens, profiled steps when not given
RUN_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3-30b-a3b": dict(batch=64, context=4096, prefill_tokens=8192, new_tokens=32, profile_steps=20),
    "tiny": dict(batch=4, context=64, prefill_tokens=128, new_tokens=8, profile_steps=8),
}


@dataclass
class Spec:
    preset: str
    layers: int
    batch: int
    context: int
    prefill_tokens: int
    new_tokens: int
    profile_steps: int
    zos: tuple[bool, ...]
    hf: bool
    device: str

    @property
    def hf_config(self) -> dict[str, Any]:
        return dict(PRESETS[self.preset], num_hidden_layers=self.layers)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_max_tokens(self) -> int:
        """Output tokens each decode request may make: new_tokens, enough measured steps, the
        profiled steps and the routing-count step, with a little slack."""
        measured = max(self.new_tokens, 1 + WARMUP_STEPS + MIN_DECODE_STEPS)
        profiled = self.profile_steps + PROFILER_WARMUP if self.cuda else 0
        gaps = self.gap_steps + 1 if self.cuda else 0
        return measured + profiled + gaps + 4

    @property
    def gap_steps(self) -> int:
        """Decode steps timed with CUDA events (`measure_gaps`)."""
        return max(self.profile_steps, 5)

    @property
    def max_model_len(self) -> int:
        return max(self.context + self.decode_max_tokens, self.prefill_tokens + 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine (whole engine steps; default sizes depend on the preset)")
    g.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    g.add_argument("--layers", type=int, help="decoder layers (default: the preset's; the table says how many)")
    g.add_argument("--batch", type=int, help="decode batch (qwen3-30b-a3b: 64, tiny: 4)")
    g.add_argument("--context", type=int, help="prompt tokens per decode sequence (4096 / 64)")
    g.add_argument("--prefill-tokens", type=int, help="tokens of the timed prefill (8192 / 128)")
    g.add_argument("--new-tokens", type=int, help="tokens generated per sequence (32 / 8)")
    g.add_argument("--profile-steps", type=int, help="decode steps under the profiler, CUDA only (20 / 8)")
    g.add_argument("--zos", choices=("both", "on", "off"), default="both", help="zero-overhead scheduling settings")
    g.add_argument("--no-hf", action="store_true", help="skip transformers generate")


def spec_from_args(args: argparse.Namespace) -> Spec:
    defaults = RUN_DEFAULTS[args.preset]
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"

    def pick(name: str) -> int:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    zos = {"both": (True, False), "on": (True,), "off": (False,)}[args.zos]
    spec = Spec(args.preset, layers, pick("batch"), pick("context"), pick("prefill_tokens"), pick("new_tokens"),
                pick("profile_steps"), zos, not args.no_hf, device)  # fmt: skip
    if min(spec.layers, spec.batch, spec.context, spec.prefill_tokens, spec.new_tokens) < 1:
        raise ValueError("--layers, --batch, --context, --prefill-tokens and --new-tokens must be >= 1")
    return spec


# ---- small helpers -------------------------------------------------------------------------------
class Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {msg}", flush=True)


def _wall_median(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings(device: str) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written) and matmul rate: `kernels.bench`'s own measurement on
    CUDA; wall-clock medians of a 32 MiB copy and a 512^3 fp32 matmul on CPU."""
    if device.startswith("cuda"):
        from kernels.bench_timing import ceilings

        bw, mm = ceilings()
        torch.cuda.empty_cache()
        name, timer = torch.cuda.get_device_name(), "CUDA events"
    else:
        a = torch.randn(1 << 23)
        b = torch.empty_like(a)
        bw = 2 * a.nbytes / _wall_median(lambda: b.copy_(a))
        x = torch.randn(512, 512)
        mm = 2 * 512**3 / _wall_median(lambda: x @ x)
        name, timer = "cpu", "wall clock"
    return {"copy_GBps": bw / 1e9, "matmul_TFLOPs": mm / 1e12, "device": name, "timer": timer}


@contextlib.contextmanager
def zos_env(on: bool) -> Iterator[None]:
    """DEEPINFER_ZERO_OVERHEAD_SCHEDULING=1/0 while the block runs (engine built and stepped), then as before."""
    from deepinfer_core import envs

    before = os.environ.get(ZOS_ENV)
    os.environ[ZOS_ENV] = "1" if on else "0"
    envs.rearm(ZOS_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ZOS_ENV, None)
        else:
            os.environ[ZOS_ENV] = before
        envs.rearm(ZOS_ENV)


def _peak_gib(device: str) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- the model directory and the engine --------------------------------------------------------
def write_model_dir(path: str, hf_config: dict[str, Any]) -> None:
    """config.json of the random model plus the shipped tokenizer (prompts are token ids; the
    tokenizer is only what the engine loads)."""
    from deepinfer_core.builtin import TINY_MODEL_DIR

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(hf_config, torch_dtype="bfloat16"), f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY_MODEL_DIR, name), os.path.join(path, name))


def num_kv_blocks(spec: Spec, block_size: int = 16) -> int:
    """KV blocks for the largest phase (the decode batch), each sequence's whole generation reserved."""

    def blocks(tokens: int) -> int:
        return (tokens + block_size - 1) // block_size + 1

    decode = spec.batch * blocks(spec.context + spec.decode_max_tokens + 1)
    return max(decode, blocks(spec.prefill_tokens + 2), 2 * blocks(spec.context + 8)) + spec.batch + 16


def build_engine(path: str, spec: Spec):
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine_args import EngineArgs

    args = EngineArgs(
        model=path,
        load_format="dummy",
        device=spec.device,
        dtype="bfloat16" if spec.cuda else "float32",
        seed=SEED,
        max_model_len=spec.max_model_len,
        num_gpu_blocks=num_kv_blocks(spec),
        max_num_seqs=spec.batch,
        max_num_batched_tokens=max(spec.max_model_len, 16384 if spec.cuda else 0),
        enable_prefix_caching=False,
    )
    return LLMEngine.from_engine_args(args)


def _params(max_tokens: int):
    from deepinfer_core.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def generate_all(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    """Run the prompts to completion (the engine's `LLM.generate` loop); the output token ids."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, params=_params(max_tokens))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[rid] for rid in ids]


# ---- decode ----------------------------------------------------------------------------------------
@dataclass
class DecodeRun:
    e2e_s: float
    """From adding the requests until every sequence had new_tokens tokens."""
    step_s: list[float]
    """Measured decode step times (after the warm-up steps)."""
    attended: list[int]
    """Tokens each sequence attended over in each measured step."""


def run_decode(engine, prompts: list[list[int]], spec: Spec) -> tuple[DecodeRun, list[str]]:
    """Add the batch, step until the e2e point and enough measured decode steps; the requests stay
    in the engine (still decoding) for the profiler and the routing count. Returns their ids too."""
    max_tokens = spec.decode_max_tokens
    ids = [f"decode-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, prompt_token_ids=p, params=_params(max_tokens))
    e2e, prev_t, prev_lo, decode_steps = None, t0, 0, 0
    step_s: list[float] = []
    attended: list[int] = []
    steps_left = 4 * (max_tokens + len(prompts)) + 50  # bounded: a stuck engine fails, it does not hang
    while e2e is None or len(step_s) < MIN_DECODE_STEPS:
        steps_left -= 1
        if steps_left < 0 or not engine.has_unfinished_requests():
            raise RuntimeError(f"the decode batch stopped short: {min(counts.values())} tokens per sequence")
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
        lo, hi = min(counts.values()), max(counts.values())
        if lo >= max_tokens:
            raise RuntimeError("the decode batch ran out of tokens before the measurement finished")
        if e2e is None and lo >= spec.new_tokens:
            e2e = now - t0
        if prev_lo >= 1 and lo == prev_lo + 1 and hi == lo:  # one token for every sequence: a decode step
            decode_steps += 1
            if decode_steps > WARMUP_STEPS:
                step_s.append(now - prev_t)
                attended.append(len(prompts[0]) + prev_lo)
        prev_t, prev_lo = now, lo
    return DecodeRun(e2e, step_s, attended), ids


def finish(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def merge_busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(span, busy) of [start, end) intervals: busy = length of their union."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (cur_s, cur_e) = 0.0, intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return max(e for _, e in intervals) - intervals[0][0], busy


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(trace_events: list[dict]) -> list[tuple[float, float]]:
    """[start, end) in µs of every kernel / memcpy / memset of a chrome trace."""
    out = []
    for e in trace_events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_EVENT_CATEGORIES:
            start = float(e["ts"])
            out.append((start, start + float(e.get("dur", 0.0))))
    return out


def measure_idle(engine, steps: int, activities: Optional[list] = None) -> dict[str, Any]:
    """GPU idle per decode step over `steps` profiled steps (see the module docstring).
    `activities`: the profiler's (default CUDA alone; a test passes CPU)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        plan = schedule(wait=0, warmup=PROFILER_WARMUP, active=steps, repeat=1)
        with profile(activities=activities or [ProfilerActivity.CUDA], schedule=plan,
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:  # fmt: skip
            for _ in range(PROFILER_WARMUP + steps):
                engine.step()
                prof.step()
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    intervals = gpu_intervals(events)
    span, busy = merge_busy(intervals)
    if not intervals or span <= 0:
        return {"idle_us_per_step": None, "busy_frac": None, "kernels": 0, "profiled_steps": steps}
    return {
        "idle_us_per_step": (span - busy) / steps,
        "busy_frac": busy / span,
        "span_ms": span / 1e3,
        "kernels": len(intervals),
        "profiled_steps": steps,
    }


def measure_gaps(engine, steps: int) -> dict[str, Any]:
    """Per decode step, from CUDA events on the engine's stream (no profiler): `gpu_ms`, from the
    start of a step's launch to the end of its queued sampling as the stream executes them, and
    `gap_us`, the stream's time between the end of one step and the start of the next: ~0 when
    the next step was queued before this one finished (the host's work was hidden), the host's
    unhidden work otherwise. Medians over `steps` steps."""
    runner = engine.worker.runner
    launch = runner.launch
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        handle = launch(*args, **kwargs)
        end.record()
        marks.append((start, end))
        return handle

    runner.launch = timed
    try:
        for _ in range(steps + 1):
            engine.step()
    finally:
        runner.launch = launch
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) for s, e in marks]
    gaps = [prev_end.elapsed_time(start) * 1e3 for (_, prev_end), (start, _) in zip(marks, marks[1:])]
    return {"gpu_ms_per_step": statistics.median(gpu), "gap_us_per_step": statistics.median(gaps)}


def count_routed_experts(engine, batch: int) -> Optional[list[int]]:
    """Distinct experts per MoE layer in one eagerly run decode step of `batch` tokens (None when no
    such forward ran). A forward pre-hook on each SparseMoeBlock recomputes the block's routing."""
    from deepinfer_core.models.layers.moe import SparseMoeBlock, select_experts

    blocks = [m for m in engine.worker.model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return []
    seen: dict[int, int] = {}

    def hook(module: SparseMoeBlock, args: tuple) -> None:
        x = args[0]
        if x.shape[0] != batch or id(module) in seen:
            return
        bias = getattr(module.gate, "e_score_correction_bias", None)
        _, ids = select_experts(module.router_logits(x), module.routing, bias)
        seen[id(module)] = int(torch.unique(ids).numel())

    handles = [b.register_forward_pre_hook(hook) for b in blocks]
    runner = engine.worker.runner
    graphs, runner.graphs = runner.graphs, None  # graph replays run no Python: this step runs eagerly
    try:
        for _ in range(2):  # a second step in case the first one's forward was launched before
            if len(seen) == len(blocks) or not engine.has_unfinished_requests():
                break
            engine.step()
    finally:
        runner.graphs = graphs
        for h in handles:
            h.remove()
    return [seen[id(b)] for b in blocks] if len(seen) == len(blocks) else None


# ---- bytes and FLOPs ---------------------------------------------------------------------------
def model_bytes(model: nn.Module, block_size: int = 16) -> dict[str, Any]:
    """The byte counts a decode step's traffic is made of, read off the engine's model."""
    from deepinfer_core.models.layers.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    stacked = {id(p) for b in blocks for p in (b.experts.w13_weight, b.experts.w2_weight)}
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
    untied = {id(w) for w in embeddings if w is not lm_head}
    dense = sum(p.nbytes for p in model.parameters() if id(p) not in stacked and id(p) not in untied)
    per_expert = [b.experts.w13_weight[0].nbytes + b.experts.w2_weight[0].nbytes for b in blocks]
    shape = model.kv_cache_block_shape(block_size)
    itemsize = next(model.parameters()).element_size()
    return {
        "total": sum(p.nbytes for p in model.parameters()),
        "dense": dense,
        "embedding_row": sum(w[0].nbytes for w in embeddings if id(w) in untied),
        "per_expert": per_expert,
        "num_experts": [b.experts.num_experts for b in blocks],
        "top_k": [b.routing.top_k for b in blocks],
        "kv_per_token": model.num_kv_cache_layers * math.prod(shape) // block_size * itemsize,
        "itemsize": itemsize,
    }


def step_weight_bytes(mb: dict[str, Any], unique: list[int], batch: int) -> int:
    """Weights one decode step reads: dense in full, `batch` embedding rows, the routed-to experts."""
    return mb["dense"] + batch * mb["embedding_row"] + sum(u * e for u, e in zip(unique, mb["per_expert"]))


def prefill_flops(mb: dict[str, Any], hf_config: dict[str, Any], tokens: int) -> float:
    """2 x active weights per token (dense minus lm_head, which runs for the last token only, plus
    top-k experts per MoE layer) + causal attention 4 * heads * head_dim * visible pairs per layer."""
    vocab, hidden = hf_config["vocab_size"], hf_config["hidden_size"]
    lm_head_params = vocab * hidden
    dense_params = mb["dense"] / mb["itemsize"] - lm_head_params
    expert_params = sum(k * e / mb["itemsize"] for k, e in zip(mb["top_k"], mb["per_expert"]))
    visible = tokens * (tokens + 1) / 2
    attn = 4 * hf_config["num_attention_heads"] * hf_config["head_dim"] * visible * hf_config["num_hidden_layers"]
    return 2 * tokens * (dense_params + expert_params) + 2 * lm_head_params + attn


# ---- prefill ---------------------------------------------------------------------------------------
def run_prefill(engine, prompt: list[int], reps: int) -> list[float]:
    """Seconds from adding one prompt (max_tokens=1) to its finished output, `reps` times after a warm-up."""
    times = []
    for r in range(reps + 1):
        rid = f"prefill-{r}"
        t = time.perf_counter()
        engine.add_request(rid, prompt_token_ids=prompt, params=_params(1))
        done, steps = False, 0
        while not done:
            if not engine.has_unfinished_requests() or steps > 50:
                raise RuntimeError("the prefill request did not finish")
            done = any(o.request_id == rid and o.finished for o in engine.step())
            steps += 1
        dt = time.perf_counter() - t
        while engine.has_unfinished_requests():  # release its blocks, untimed
            engine.step()
        if r:
            times.append(dt)
    return times


# ---- transformers on the engine's tensors ------------------------------------------------------------
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _engine_view(name: str, shape: torch.Size, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The engine tensor (or a view of it) that HF's parameter `name` is: same names for everything
    but the experts; transformers 5 stacks them as gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    (the engine's w13 / w2), transformers 4 keeps experts.{e}.{gate,up,down}_proj.weight."""
    tensor = params.get(name)
    if tensor is None and (m := _STACKED.match(name)):
        tensor = params.get(f"{m['prefix']}.{'w13_weight' if m['proj'] == 'gate_up_proj' else 'w2_weight'}")
    if tensor is None and (m := _PER_EXPERT.match(name)):
        e, w13 = int(m["e"]), params.get(f"{m['prefix']}.w13_weight")
        if w13 is not None:
            inter = w13.shape[1] // 2
            tensor = {"gate_proj": w13[e, :inter], "up_proj": w13[e, inter:]}.get(m["proj"])
            if tensor is None:
                tensor = params[f"{m['prefix']}.w2_weight"][e]
    if tensor is None:
        raise KeyError(f"transformers parameter {name!r} has no counterpart in the engine's model")
    if tensor.shape != shape and tensor.dim() == 3 and tensor.transpose(1, 2).shape == shape:
        tensor = tensor.transpose(1, 2)  # an [E, in, out] expert layout
    if tensor.shape != shape:
        raise ValueError(f"{name}: engine tensor {tuple(tensor.shape)}, transformers wants {tuple(shape)}")
    return tensor.detach()


def hf_model_sharing(model: nn.Module, hf_config: dict[str, Any], device: str):
    """A transformers Qwen3-MoE model whose parameters ARE the engine model's tensors (built on the
    meta device, parameters assigned; modules with computed buffers, the rotary embedding, rebuilt
    on `device`)."""
    import transformers

    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = transformers.Qwen3MoeConfig(**fields)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
    params = dict(model.named_parameters())
    state = {name: _engine_view(name, p.shape, params) for name, p in hf.named_parameters()}
    hf.load_state_dict(state, strict=True, assign=True)
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device(device):
                rebuilt = type(module)(getattr(module, "config", config))
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, attr, rebuilt)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model still has meta tensors: {left[:5]}")
    return hf.eval()


def _benchmark_helpers():
    """`run_hf` of benchmarks/model_throughput.py (the repo's transformers timing), imported from
    its folder the way the benchmark scripts import each other."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import model_throughput

    return model_throughput.run_hf


# ---- the whole run ---------------------------------------------------------------------------------
def run_engine_bench(
    spec: Spec,
    log: Optional[Log] = None,
    on_update: Optional[Callable[[dict], None]] = None,
    res: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Measure everything the module docstring lists into `res` (a new dict when None) and return it.
    `on_update(res)` runs after each phase, and `res` holds every finished phase if a later one
    raises, so a cut-short run still leaves its numbers."""
    log = log or Log()
    hf_config = spec.hf_config
    full_layers = PRESETS[spec.preset]["num_hidden_layers"]
    res = {} if res is None else res
    res.update(
        {
            "preset": spec.preset,
            "layers": spec.layers,
            "layers_full": full_layers,
            "batch": spec.batch,
            "context": spec.context,
            "prefill_tokens": spec.prefill_tokens,
            "new_tokens": spec.new_tokens,
            "dtype": "bfloat16" if spec.cuda else "float32",
            "decode": [],
            "peak_gib": {},
        }
    )

    def update() -> None:
        if on_update is not None:
            on_update(res)

    log(f"preset {spec.preset}, {spec.layers}/{full_layers} layers, batch {spec.batch}, context {spec.context}, "
        f"prefill {spec.prefill_tokens}, new tokens {spec.new_tokens}, device {spec.device}")  # fmt: skip
    res["ceilings"] = measure_ceilings(spec.device)
    bw = res["ceilings"]["copy_GBps"] * 1e9
    log(f"ceilings: copy {res['ceilings']['copy_GBps']:.0f} GB/s, matmul {res['ceilings']['matmul_TFLOPs']:.1f} "
        f"TFLOP/s ({res['ceilings']['timer']})")  # fmt: skip
    update()
    vocab = hf_config["vocab_size"]
    prompts = random_prompts(spec.batch, spec.context, vocab, seed=1)
    prefill_prompt = random_prompts(1, spec.prefill_tokens, vocab, seed=2)[0]
    shared_model = None
    with tempfile.TemporaryDirectory() as path:
        write_model_dir(path, hf_config)
        for i, zos in enumerate(spec.zos):
            first, last = i == 0, i == len(spec.zos) - 1
            tag = f"ZOS {'on' if zos else 'off'}"
            _reset_peak(spec.device)
            with zos_env(zos):
                log(f"{tag}: building the engine (dummy weights, {'CUDA graphs' if spec.cuda else 'eager'})")
                engine = build_engine(path, spec)
                model = engine.worker.model
                if first:
                    res["model_bytes"] = mb = model_bytes(model)
                    log(f"{tag}: weights {_size(mb['total'])}, KV {_size(mb['kv_per_token'])}/token")
                    log(f"{tag}: prefill {spec.prefill_tokens} tokens x {1 + PREFILL_REPS} (first is warm-up)")
                    times = run_prefill(engine, prefill_prompt, PREFILL_REPS)
                    t = statistics.median(times)
                    flops = prefill_flops(mb, hf_config, spec.prefill_tokens)
                    res["prefill"] = {
                        "zos": zos,
                        "tokens": spec.prefill_tokens,
                        "ms": [x * 1e3 for x in times],
                        "ms_median": t * 1e3,
                        "tok_s": spec.prefill_tokens / t,
                        "tflops": flops / t / 1e12,
                        "mfu": flops / t / (res["ceilings"]["matmul_TFLOPs"] * 1e12),
                    }
                    log(f"{tag}: prefill {t * 1e3:.1f} ms = {spec.prefill_tokens / t:,.0f} tok/s")
                    update()
                log(f"{tag}: warm-up generate (2 x {spec.context} tokens)")
                generate_all(engine, prompts[:2], 3, f"warm{i}")
                log(f"{tag}: decode batch {spec.batch} x {spec.context} tokens, {spec.new_tokens} new")
                run, ids = run_decode(engine, prompts, spec)
                step = statistics.median(run.step_s)
                row: dict[str, Any] = {
                    "zos": zos,
                    "step_ms_median": step * 1e3,
                    "step_ms": [x * 1e3 for x in run.step_s],
                    "attended_mean": statistics.fmean(run.attended),
                    "decode_tok_s": spec.batch / step,
                    "e2e_s": run.e2e_s,
                    "gen_tok_s": spec.batch * spec.new_tokens / run.e2e_s,
                    "idle_us_per_step": None,
                    "busy_frac": None,
                    "gpu_ms_per_step": None,
                    "gap_us_per_step": None,
                }
                log(f"{tag}: decode step {step * 1e3:.2f} ms (median of {len(run.step_s)}), "
                    f"generate {run.e2e_s:.2f} s")  # fmt: skip
                if spec.cuda:
                    row.update(measure_gaps(engine, spec.gap_steps))
                    log(f"{tag}: events: GPU {row['gpu_ms_per_step']:.2f} ms/step, "
                        f"gap between steps {row['gap_us_per_step']:.0f} µs")  # fmt: skip
                if spec.cuda and spec.profile_steps > 0:
                    log(f"{tag}: profiling {spec.profile_steps} decode steps (CUDA activity only)")
                    try:
                        row.update(measure_idle(engine, spec.profile_steps))
                        if row["idle_us_per_step"] is not None:
                            log(f"{tag}: GPU idle {row['idle_us_per_step']:.0f} µs/step, busy {row['busy_frac']:.1%}")
                        else:
                            log(f"{tag}: the trace held no kernel events: idle n/a")
                    except Exception as exc:  # a profiler that will not start must not cost the rest
                        log(f"{tag}: profiler failed ({type(exc).__name__}: {str(exc)[:200]}): idle n/a")
                if "unique_experts" not in res:
                    log(f"{tag}: one eager decode step to count the routed experts")
                    unique = count_routed_experts(engine, spec.batch)
                    res["routing"] = "measured (eager step, hooks on the MoE blocks)"
                    if unique is None:
                        unique = list(res["model_bytes"]["num_experts"])
                        res["routing"] = "upper bound: every expert (no eager decode forward was seen)"
                    res["unique_experts"] = unique
                    res["step_weight_bytes"] = step_weight_bytes(res["model_bytes"], unique, spec.batch)
                    touched = "n/a (no MoE layers)"
                    if unique:
                        touched = f"{statistics.fmean(unique):.1f}/{res['model_bytes']['num_experts'][0]}"
                    log(f"{tag}: experts touched per layer {touched}, "
                        f"weights read {_size(res['step_weight_bytes'])}/step")  # fmt: skip
                finish(engine, ids)
                row["kv_bytes"] = spec.batch * row["attended_mean"] * res["model_bytes"]["kv_per_token"]
                row["bytes"] = res["step_weight_bytes"] + row["kv_bytes"]
                row["gbps"] = row["bytes"] / step / 1e9
                row["bw_util"] = row["bytes"] / step / bw
                row["peak_gib"] = res["peak_gib"][f"engine {tag}"] = _peak_gib(spec.device)
                res["decode"].append(row)
                log(f"{tag}: {_size(row['bytes'])}/step -> {row['gbps']:.4g} GB/s = "
                    f"{row['bw_util']:.1%} of copy bandwidth")  # fmt: skip
                update()
                if last and spec.hf:
                    shared_model = model
                del engine, model
                _free(spec.device)
        if shared_model is not None:
            _reset_peak(spec.device)
            log(f"transformers: generate, batch {spec.batch} x {spec.context} tokens, on the same tensors")
            try:
                run_hf = _benchmark_helpers()
                hf = hf_model_sharing(shared_model, hf_config, spec.device)
                dtype = torch.bfloat16 if spec.cuda else torch.float32
                hf_s = run_hf(hf, prompts, None, spec.new_tokens, spec.device, dtype)
            except Exception as exc:  # e.g. out of memory: the engine's numbers stand without it
                res["transformers_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"transformers failed: {res['transformers_error']}")
            else:
                res["transformers"] = {"e2e_s": hf_s, "gen_tok_s": spec.batch * spec.new_tokens / hf_s}
                res["peak_gib"]["transformers"] = _peak_gib(spec.device)
                for row in res["decode"]:
                    row["ratio_vs_hf"] = row["gen_tok_s"] / res["transformers"]["gen_tok_s"]
                log(f"transformers: generate {hf_s:.2f} s")
            hf = shared_model = None
            _free(spec.device)
            update()
    return res


# ---- report ----------------------------------------------------------------------------------------
def _f(value: Optional[float], fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, fmt) + suffix


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def format_report(res: dict[str, Any]) -> str:
    """The tables `--engine` prints (markdown, like `kernels.bench`'s)."""
    c, mb = res["ceilings"], res.get("model_bytes")
    timer = "wall clock" if c["timer"] == "wall clock" else "wall clock (steps), CUDA events (ceilings)"
    out = [
        f"engine bench: {res['preset']}, {res['layers']}/{res['layers_full']} layers, {res['dtype']}, device "
        f"{c['device']}: copy {c['copy_GBps']:.4g} GB/s (read+write), matmul {c['matmul_TFLOPs']:.3g} TFLOP/s; "
        f"times by {timer}",
        f"decode: batch {res['batch']} x context {res['context']}, {res['new_tokens']} new tokens each; "
        f"prefill: {res['prefill_tokens']} tokens",
    ]
    if mb is not None and "unique_experts" in res:
        unique, total_experts = res["unique_experts"], mb["num_experts"]
        experts = sum(u * e for u, e in zip(unique, mb["per_expert"]))
        touched = f"{statistics.fmean(unique):.1f}/{total_experts[0]}" if unique else "no MoE layers"
        out.append(
            f"weights {_size(mb['total'])}; read per decode step {_size(res['step_weight_bytes'])} = dense "
            f"{_size(mb['dense'])} + embedding rows {_size(res['batch'] * mb['embedding_row'])} + experts "
            f"{_size(experts)} ({touched} per layer, {res['routing']}); KV {_size(mb['kv_per_token'])}/token"
        )
    if res["decode"]:
        out += [
            "",
            "| ZOS | decode step ms | decode tok/s | GPU ms/step (events) | gap between steps µs (events) "
            "| GPU idle µs/step (profiler) | GPU busy | attended/seq | bytes/step "
            "(weights+KV) | GB/s | BW util | generate s | gen tok/s | vs transformers | peak GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]  # fmt: skip
        for r in res["decode"]:
            busy = None if r["busy_frac"] is None else r["busy_frac"] * 100
            out.append(
                f"| {'on' if r['zos'] else 'off'} | {r['step_ms_median']:.2f} | {r['decode_tok_s']:,.0f} | "
                f"{_f(r.get('gpu_ms_per_step'), '.2f')} | {_f(r.get('gap_us_per_step'), '.0f')} | "
                f"{_f(r['idle_us_per_step'], '.0f')} | {_f(busy, '.1f', '%')} | {r['attended_mean']:.0f} | "
                f"{_size(r['bytes'])} | {r['gbps']:.4g} | {r['bw_util']:.1%} | {r['e2e_s']:.2f} | "
                f"{r['gen_tok_s']:,.0f} | {_f(r.get('ratio_vs_hf'), '.2f', '×')} | {_f(r['peak_gib'], '.1f')} |"
            )
    if "transformers" in res:
        t = res["transformers"]
        out.append(
            f"\ntransformers generate (same tensors, greedy, batch {res['batch']}): {t['e2e_s']:.2f} s = "
            f"{t['gen_tok_s']:,.0f} tok/s; peak {_f(res['peak_gib'].get('transformers'), '.1f', ' GiB')}"
        )
    if "transformers_error" in res:
        out.append(f"\ntransformers generate failed: {res['transformers_error']}")
    if "prefill" in res:
        p = res["prefill"]
        out += [
            "",
            f"| prefill tokens (ZOS {'on' if p['zos'] else 'off'}) | ms (median) | tok/s | TFLOP/s | of matmul rate |",
            "|---:|---:|---:|---:|---:|",
            f"| {p['tokens']} | {p['ms_median']:.1f} | {p['tok_s']:,.0f} | {p['tflops']:.3g} | {p['mfu']:.1%} |",
        ]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    log = Log()

    def dump(res: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**res, "spec": asdict(spec)}, f, indent=1)

    res: dict[str, Any] = {}
    rc = 0
    try:
        run_engine_bench(spec, log, dump, res)
    except Exception:  # report what was measured before the failure, then fail
        traceback.print_exc()
        rc = 1
    if "ceilings" in res:
        print()
        print(format_report(res), flush=True)
    return rc
