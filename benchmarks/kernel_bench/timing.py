"""`python -m benchmarks.kernel_bench` on a GPU: time every kernel at its target shapes.

Each row: median time of the Triton kernel, achieved bytes/s and FLOP/s, the floor (bytes that
must move / measured copy bandwidth, or FLOPs / measured bf16 matmul rate, whichever is
larger), floor/time, and the baseline it must beat (torch reference or SDPA flash) with
baseline/time. `--sweep` adds one row per candidate tile config (marked `sweep`).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from triton.testing import do_bench, do_bench_cudagraph

from deepinfer_kernels import ops
from deepinfer_kernels.attention_refs import paged_decode_attention_ref
from deepinfer_kernels.cache_ops import copy_blocks_ref
from deepinfer_kernels.fp8 import dequantize_block_fp8, dequantize_gate_up, quantize_block_fp8
from deepinfer_kernels.fused_moe import fused_moe_ref, moe_topk_ref
from deepinfer_kernels.mla_decode import mla_decode_attention_ref
from deepinfer_kernels.paged_attention import reshape_and_cache_static
from deepinfer_kernels.registry import triton_module
from deepinfer_kernels.rms_norm import rms_norm_ref
from deepinfer_kernels.rotary import rotary_ref

DEV = "cuda"
BF16 = torch.bfloat16


FLUSH_BYTES = 256 << 20  # ~5x an H100/H200's L2, as `do_bench` flushes


@functools.cache
def _flush_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(FLUSH_BYTES // 2 // 4096, 4096, device=DEV, dtype=torch.float16), torch.empty(
        1, 4096, device=DEV, dtype=torch.float16
    )


def _host_us(fn: Callable[[], object], calls: int = 5) -> float:
    """Host time to launch `fn` (no synchronization), µs per call."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def cold_ms(fn: Callable[[], object], rep: int, flush: str = "read") -> float:
    """Median ms of CUDA-event timings of `fn`, each after L2 is emptied of its data by a 256 MB flush,
    over ~`rep` ms of repetitions.

    `memset` is `triton.testing.do_bench`: it zeroes the buffer, which leaves L2 full of dirty lines
    that the op then writes back before its own reads get the memory. That adds a fixed cost to every
    op, which no op pays in an engine step (the kernels before it leave weights, clean lines, in L2).
    `read` empties L2 by reading the buffer (a max over it): the op starts as cold, with nothing to
    write back.

    The stream is held by a GPU spin before each flush, longer than the host takes to launch `fn`,
    so the start event never fires while the host is still launching: an op whose host time exceeds
    its GPU time plus the flush's would otherwise be timed with the host's launch in it.
    Figures: docs/benchmarks.md, "Figures formerly in code"."""
    if flush == "memset":
        return do_bench(fn, warmup=10, rep=rep, return_mode="median")
    buf, out = _flush_buffers()
    est = do_bench(fn, warmup=1, rep=5, return_mode="median")
    # >= that many µs at clocks up to 2 GHz; capped for references that synchronize inside (they wait it out)
    hold_cycles = int(min(2 * _host_us(fn) + 100, 2000) * 2000)
    pairs = []
    for _ in range(max(10, min(1000, int(rep / max(est, 1e-3))))):
        torch.cuda._sleep(hold_cycles)
        torch.amax(buf, dim=0, keepdim=True, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def bench_ms(
    fn: Callable[[], object], rep: int = 100, graph: bool = False, rounds: int = 3, flush: str = "read"
) -> float:
    """Median ms of CUDA-event timings after an L2 flush (`cold_ms`); `graph`: of CUDA-graph replays
    (no launch overhead, L2 warm), for decode-sized ops that the engine runs inside its decode graphs.

    The median of `rounds` separate medians (the lent card is shared), after 250 ms of warm-up (an
    idle card takes longer than do_bench's default 25 ms to reach its clocks)."""
    if graph:
        fn()  # compile outside the capture
        return statistics.median(do_bench_cudagraph(fn, rep=rep, return_mode="median") for _ in range(rounds))
    do_bench(fn, warmup=250, rep=1)
    return statistics.median(cold_ms(fn, rep, flush) for _ in range(rounds))


def ceilings(flush: str = "read") -> tuple[float, float]:
    """Copy bandwidth (bytes read + written, 1 GiB) and bf16 matmul rate (8192^3), timed like the
    rows they are the floors of (the same flush)."""
    a = torch.randn(1 << 29, device=DEV, dtype=BF16)
    b = torch.empty_like(a)
    bw = 2 * a.nbytes / (bench_ms(lambda: b.copy_(a), flush=flush) * 1e-3)
    x, y = (torch.randn(8192, 8192, device=DEV, dtype=BF16) for _ in range(2))
    mm = 2 * 8192**3 / (bench_ms(lambda: x @ y, flush=flush) * 1e-3)
    return bw, mm


class Bench:
    def __init__(self, sweep: list[str] | None, flush: str = "read"):
        self.sweep_names = sweep or []
        self.flush = flush
        self.rows: list[dict] = []
        self.bw, self.mm = ceilings(flush)

    def add(self, kernel, shape, fn, nbytes, flops, base_name=None, base_fn=None, tag="", rep=100, graph=False,
            base_graph=None):  # fmt: skip
        try:
            t = bench_ms(fn, rep if not tag else 50, graph, flush=self.flush) * 1e-3
        except Exception as exc:  # e.g. a sweep config out of shared memory: report, keep going
            print(f"{kernel} {shape} {tag}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        floor_b, floor_f = nbytes / self.bw, flops / self.mm
        row = dict(
            kernel=kernel, shape=shape, tag=tag, time_us=t * 1e6, gbps=nbytes / t / 1e9, tflops=flops / t / 1e12,
            floor_us=max(floor_b, floor_f) * 1e6, bound="mem" if floor_b >= floor_f else "compute",
            ratio=max(floor_b, floor_f) / t, base=base_name, base_us=None, speedup=None,
        )  # fmt: skip
        if base_fn is not None:
            tb = bench_ms(base_fn, rep, graph if base_graph is None else base_graph, flush=self.flush) * 1e-3
            row.update(base_us=tb * 1e6, speedup=tb / t)
        self.rows.append(row)

    def sweeps(self, kernel: str) -> bool:
        return "all" in self.sweep_names or kernel in self.sweep_names

    # -- attention ----------------------------------------------------------------------------
    def decode(self, B: int, ctx: int, hq: int, hkv: int = 8, d: int = 128, page: int = 16, tiles: bool = True):
        W = ctx // page
        cache = torch.randn(B * W + 1, 2, page, hkv, d, device=DEV, dtype=BF16)
        bt = torch.randperm(B * W + 1, device=DEV)[: B * W].view(B, W).to(torch.int32)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(B, hq, d, device=DEV, dtype=BF16)
        scale = d**-0.5
        nbytes, flops = B * ctx * hkv * d * 2 * 2 + 2 * q.nbytes + bt.nbytes, 4 * B * hq * ctx * d
        shape = f"B={B} ctx={ctx} Hq={hq} Hkv={hkv} D={d}"
        impl = triton_module("decode_attention")
        self.add("paged_decode_attention", shape, lambda: impl.paged_decode_attention(q, cache, bt, lens, scale),
                 nbytes, flops, "torch ref", lambda: paged_decode_attention_ref(q, cache, bt, lens, scale))  # fmt: skip
        if self.sweeps("paged_decode_attention"):
            cfgs = impl.CANDIDATES if tiles else [impl.default_config(d, hq // hkv)]
            for cfg, splits in itertools.product(cfgs, (1, 2, 4, 8) if tiles else (4, 8, 16)):
                fn = partial(impl.paged_decode_attention, q, cache, bt, lens, scale, num_splits=splits, config=cfg)
                self.add("paged_decode_attention", shape, fn, nbytes, flops, tag=f"sweep {cfg} splits={splits}")

    def mla(self, B: int, ctx: int, H: int, lora: int = 512, rope: int = 64, page: int = 64, tl_row: bool = True):
        W = ctx // page
        cache = torch.randn(B * W + 1, page, lora + rope, device=DEV, dtype=BF16)
        bt = torch.randperm(B * W + 1, device=DEV)[: B * W].view(B, W).to(torch.int32)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        qn, qp = torch.randn(B, H, lora, device=DEV, dtype=BF16), torch.randn(B, H, rope, device=DEV, dtype=BF16)
        scale = 192**-0.5
        nbytes = B * ctx * (lora + rope) * 2 + qn.nbytes * 2 + qp.nbytes + bt.nbytes
        flops = 2 * B * H * ctx * (lora + rope + lora)
        shape = f"B={B} ctx={ctx} H={H} lora={lora} rope={rope} page={page}"
        impl = triton_module("mla_decode")
        args = (qn, qp, cache, bt, lens, scale)
        self.add("mla_decode_attention", shape, lambda: impl.mla_decode_attention(*args), nbytes, flops,
                 "torch ref", lambda: mla_decode_attention_ref(*args))  # fmt: skip
        if tl_row:  # the tl.dot kernel in the same run: what the sm_90 warp-group kernels gain over it
            tl_cfg = {**impl.default_config(H, lora), "kernel": "tl"}
            self.add("mla_decode_attention", shape, partial(impl.mla_decode_attention, *args, config=tl_cfg),
                     nbytes, flops, tag="tl.dot kernel")  # fmt: skip
        if self.sweeps("mla_decode_attention"):
            cfgs = [c for c in impl.CANDIDATES if (c["BLOCK_H"] <= 16) == (H <= 16)]
            ref = mla_decode_attention_ref(*args).float()
            cfgs = [{"kernel": "auto", "per_sm": 1}] + [{**c, "kernel": "tl"} for c in cfgs]
            for cfg, splits in itertools.product(cfgs, (1, 2, 4) if H > 16 else (2, 4, 8)):
                fn = partial(impl.mla_decode_attention, *args, num_splits=splits, config=cfg)
                try:  # a tile config that compiles must also be right
                    err = (fn().float() - ref).abs().max().item()
                except Exception as exc:
                    print(f"mla_decode_attention {shape} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                tag = f"sweep {cfg} splits={splits} err={err:.1e}"
                self.add("mla_decode_attention", shape, fn, nbytes, flops, tag=tag)

    def prefill(self, cached: list[int], new: list[int], hq: int = 32, hkv: int = 8, d: int = 128, page: int = 16):
        seq_lens = [c + n for c, n in zip(cached, new)]
        widths = [(n + page - 1) // page for n in seq_lens]
        nb = sum(widths) + 1
        perm = torch.randperm(nb, device=DEV)
        bt = torch.zeros(len(new), max(widths), dtype=torch.int32, device=DEV)
        start = 0
        for i, w in enumerate(widths):
            bt[i, :w] = perm[start : start + w]
            start += w
        cache = torch.randn(nb, 2, page, hkv, d, device=DEV, dtype=BF16)
        q = torch.randn(sum(new), hq, d, device=DEV, dtype=BF16)
        qsl = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device=DEV)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        scale = d**-0.5
        visible = sum(n * c + n * (n + 1) // 2 for c, n in zip(cached, new))
        flops = 4 * d * hq * visible
        nbytes = 2 * q.nbytes + sum(seq_lens) * hkv * d * 2 * 2
        shape = f"cached={cached} new={new} Hq={hq} Hkv={hkv} D={d}"
        impl = triton_module("prefill_attention")
        args = (q, cache, bt, qsl, lens, max(new), scale)
        base_name = base_fn = None
        if len(new) == 1 and cached == [0]:  # the same problem for SDPA's flash backend, contiguous K/V
            base_name, base_fn = "SDPA flash", self._sdpa_flash(new[0], hq, hkv, d, scale)
        self.add("paged_prefill_attention", shape, lambda: impl.paged_prefill_attention(*args), nbytes, flops,
                 base_name, base_fn)  # fmt: skip
        if self.sweeps("paged_prefill_attention"):
            for cfg in impl.CANDIDATES:
                fn = partial(impl.paged_prefill_attention, *args, config=cfg)
                self.add("paged_prefill_attention", shape, fn, nbytes, flops, tag=f"sweep {cfg}")

    @staticmethod
    def _sdpa_flash(T: int, hq: int, hkv: int, d: int, scale: float) -> Callable[[], object]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, hq, T, d, device=DEV, dtype=BF16)
        k, v = (torch.randn(1, hkv, T, d, device=DEV, dtype=BF16) for _ in range(2))
        F = torch.nn.functional

        def gqa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        try:
            gqa()
            return gqa
        except RuntimeError:  # a flash backend without GQA: give it the expanded heads (same FLOPs)
            ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)

            def mha():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True, scale=scale)

            return mha

    # -- MoE ----------------------------------------------------------------------------------
    def moe(self, name: str, T: int, H: int, inter: int, E: int, k: int, fp8: bool = False, **routing) -> None:
        """`fp8`: the expert weights block-scaled FP8 ([128, 128], DeepSeek-V3's release), its baseline
        the bf16 kernel on the same (dequantized) weights."""
        torch.manual_seed(T + E)
        w13 = torch.randn(E, 2 * inter, H, device=DEV, dtype=BF16).mul_(H**-0.5)
        w2 = torch.randn(E, H, inter, device=DEV, dtype=BF16).mul_(inter**-0.5)
        scales, wbytes = {}, 2
        if fp8:
            block = (128, 128)
            (gq, gs), (uq, us), (w2, s2) = (quantize_block_fp8(w, block) for w in (w13[:, :inter], w13[:, inter:], w2))
            w13, wbytes = torch.cat([gq, uq], dim=1), 1
            scales = dict(w13_scale=torch.cat([gs, us], dim=1), w2_scale=s2, fp8_block=block)
            bf16_w13 = dequantize_gate_up(w13, scales["w13_scale"], block, BF16)
            bf16_w2 = dequantize_block_fp8(w2, s2, block, BF16)
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        logits = torch.randn(T, E, device=DEV, dtype=torch.float32)
        if routing.pop("bias", False):
            routing["correction_bias"] = torch.randn(E, device=DEV) * 0.1
        _, ids = moe_topk_ref(logits, k, **routing)
        active = int(torch.unique(ids).numel())
        nbytes = active * 3 * H * inter * wbytes + 2 * x.nbytes + logits.nbytes
        flops = 6 * T * k * H * inter
        shape = f"{name} T={T} (experts touched {active}/{E})" + (" FP8 [128,128]" if fp8 else "")

        def run(cfgs=None, w13=w13, w2=w2, scales=scales):
            w, i = ops.moe_topk(logits, k, backend="triton", **routing)
            return triton_module("fused_moe").fused_experts(x, w13, w2, w, i, configs=cfgs, **scales)

        decode = T * k <= 16 * E  # timed as CUDA-graph replays, as the engine's decode runs it
        if fp8:
            self.add("fused_moe", shape + (" (graph replay)" if decode else ""), run, nbytes, flops,
                     "bf16 kernel", partial(run, w13=bf16_w13, w2=bf16_w2, scales={}), graph=decode)  # fmt: skip
            return
        self.add("fused_moe", shape + (" (graph replay; torch ref eager: it syncs)" if decode else ""), run, nbytes,
                 flops, "torch ref", lambda: fused_moe_ref(x, w13, w2, logits, k, **routing), graph=decode,
                 base_graph=False)  # fmt: skip
        if self.sweeps("fused_moe") and T * k > 16 * E:  # prefill tiles (decode tiles were settled on an H200 earlier)
            for up, down in triton_module("fused_moe").PREFILL_CANDIDATES:
                self.add("fused_moe", shape, partial(run, (up, down)), nbytes, flops, tag=f"sweep up={up} down={down}")

    # -- elementwise and cache ops ------------------------------------------------------------
    def small_ops(self) -> None:
        for T, H in ((8192, 4096), (64, 7168)):
            x, r = (torch.randn(T, H, device=DEV, dtype=BF16) for _ in range(2))
            w = torch.randn(H, device=DEV, dtype=BF16)
            graph = T < 1024  # decode-sized: timed as graph replays, as the engine runs it
            self.add("rms_norm", f"T={T} H={H} +residual" + (" (graph replay)" if graph else ""),
                     lambda x=x, r=r, w=w: ops.rms_norm(x, w, 1e-6, r), 4 * x.nbytes + w.nbytes, 0,
                     "torch ref", lambda x=x, r=r, w=w: rms_norm_ref(x, w, 1e-6, r), graph=graph)  # fmt: skip
        T, H, D = 8192, 32, 128
        x = torch.randn(T, H, D, device=DEV, dtype=BF16)
        cs = torch.randn(T, D, device=DEV)
        cos, sin = cs.chunk(2, dim=-1)
        self.add("rotary", f"T={T} H={H} D={D}", lambda: ops.rotary(x, cos, sin), 2 * x.nbytes + cs.nbytes, 0,
                 "torch ref", lambda: rotary_ref(x, cos, sin))  # fmt: skip
        hkv, page = 8, 16
        k, v = (torch.randn(T, hkv, D, device=DEV, dtype=BF16) for _ in range(2))
        cache = torch.zeros(T // page + 8, 2, page, hkv, D, device=DEV, dtype=BF16)
        slots = torch.randperm(cache.shape[0] * page, device=DEV)[:T]
        self.add("reshape_and_cache", f"T={T} Hkv={hkv} D={D}", lambda: ops.reshape_and_cache(k, v, cache, slots),
                 4 * k.nbytes, 0, "torch ref", lambda: reshape_and_cache_static(k, v, cache, slots))  # fmt: skip
        L, N, P = 48, 1024, 256
        buf = torch.randn(L, N, 2, page, hkv, D, device=DEV, dtype=BF16)
        perm = torch.randperm(N, device=DEV)
        src, dst = perm[:P], perm[P : 2 * P]
        nbytes = 2 * L * P * buf[0, 0].nbytes
        self.add("copy_blocks", f"L={L} pairs={P} block=[2,{page},{hkv},{D}]", lambda: ops.copy_blocks(buf, src, dst),
                 nbytes, 0, "torch ref", lambda: copy_blocks_ref(buf, src, dst))  # fmt: skip


DEEPSEEK_ROUTING = dict(scoring="sigmoid", num_groups=8, topk_groups=4, bias=True, routed_scaling_factor=2.5)


def run_timings(
    sweep: list[str] | None = None, only: list[str] | None = None, flush: str = "read"
) -> tuple[list[dict], dict]:
    """Time every target shape (kernels in `only`, default all); sweep the kernels in `sweep` ("all": every
    one); `flush`: how L2 is emptied before each timed run (`cold_ms`)."""
    b = Bench(sweep, flush)

    def want(name: str) -> bool:
        return not only or name in only

    if want("paged_decode_attention"):
        b.decode(64, 4096, 32)
        b.decode(64, 4096, 64, tiles=False)
        b.decode(4, 32768, 32, tiles=False)
    if want("mla_decode_attention"):
        # pages of 64 tokens: the engine's KV block for MLA models on CUDA (engine_args.default_block_size)
        b.mla(64, 4096, 16)  # a tensor-parallel rank's share of DeepSeek-V3's heads at TP 8
        b.mla(64, 4096, 32)  # ... at TP 4
        b.mla(64, 4096, 128)  # all heads on one GPU (data-parallel attention)
        b.mla(64, 4096, 128, page=16, tl_row=False)  # --block-size 16
    if want("paged_prefill_attention"):
        b.prefill([0], [8192])
        b.prefill([4096] * 4, [2048] * 4)
    if want("fused_moe"):
        for T in (64, 8192):
            b.moe("Qwen3-30B-A3B", T, 2048, 768, 128, 8, scoring="softmax")
            b.moe("DeepSeek-V3", T, 7168, 2048, 256, 8, **DEEPSEEK_ROUTING)
            torch.cuda.empty_cache()
            b.moe("DeepSeek-V3", T, 7168, 2048, 256, 8, fp8=True, **DEEPSEEK_ROUTING)
            torch.cuda.empty_cache()
    if want("small_ops"):
        b.small_ops()
    ceilings = {"copy_GBps": b.bw / 1e9, "matmul_TFLOPs": b.mm / 1e12, "device": torch.cuda.get_device_name(),
                "flush": flush}  # fmt: skip
    print(format_table(b.rows, ceilings))
    return b.rows, ceilings


def format_table(rows: list[dict], ceilings: dict) -> str:
    out = [
        f"device {ceilings['device']}: copy {ceilings['copy_GBps']:.0f} GB/s (read+write), "
        f"bf16 matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s; L2 flushed by a {ceilings['flush']} before each run",
        "",
        "| kernel | shape | time µs | GB/s | TFLOP/s | floor µs (bound) | floor/time | baseline | baseline µs | baseline/time |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        shape = r["shape"] + (f" [{r['tag']}]" if r["tag"] else "")
        base = f"{r['base_us']:.1f}" if r["base_us"] is not None else ""
        speed = f"{r['speedup']:.2f}×" if r["speedup"] is not None else ""
        out.append(
            f"| {r['kernel']} | {shape} | {r['time_us']:.1f} | {r['gbps']:.0f} | {r['tflops']:.1f} | "
            f"{r['floor_us']:.1f} ({r['bound']}) | {r['ratio']:.2f} | {r['base'] or ''} | {base} | {speed} |"
        )
    return "\n".join(out)
