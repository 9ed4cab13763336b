"""Wide-EP on one GPU: what one expert-parallel rank computes, and the padded dispatch in a CUDA graph.

1. Per-layer MoE compute at DeepSeek-V3 widths (bf16, random weights, the project's
   `SparseMoeBlock`): the full layer (256 experts; the fused Triton kernel an EP=1 engine runs,
   and the grouped GEMM an EP rank runs) against a 1/N expert shard (one EP rank of N: 256/N
   experts, only the token copies routed to them), for decode batches. Router and shared expert
   run over the whole batch in every case; "router + shared" is that fixed part alone.
2. The padded dispatcher (`PaddedAllToAllDispatcher`) over a real NCCL group, eager and captured
   in a CUDA graph: the replay must give the eager outputs, also after the inputs are overwritten
   with another routing (the graph's shapes do not depend on it). NCCL refuses two ranks on one
   device, so this runs on a world of one rank (a real NCCL all-to-all to itself); two ranks on
   the device are also tried, in child processes, and the outcome is reported.

    python benchmarks/wide_ep.py --gpu [--batches 32 128 512] [--shards 2 4 8]

`--smoke` runs every part at tiny widths (on CPU: gloo and no graph capture), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as pyqueue
import statistics
import time
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from deepinfer_core.distributed.expert_parallel import apply_expert_parallel
from deepinfer_core.distributed.group import join_instance, leave_instance
from deepinfer_core.models.deepseek_v3 import deepseek_routing
from deepinfer_core.models.layers.moe import SparseMoeBlock, building_local_experts
from deepinfer_kernels.registry import get_backend, set_backend

DSV3 = dict(hidden=7168, experts=256, top_k=8, n_group=8, topk_group=4, moe_intermediate=2048, shared=2048)
TINY = dict(hidden=64, experts=16, top_k=4, n_group=8, topk_group=4, moe_intermediate=32, shared=32)


def moe_layer(w: dict, device: torch.device, dtype: torch.dtype, slots: list[int] | None = None, seed: int = 0):
    """A DeepSeek-V3-shaped MoE layer with random weights (std 0.02, a random correction bias);
    `slots`: the experts it holds (an EP rank's shard), all when None."""
    cfg = dict(model_type="deepseek_v3", n_routed_experts=w["experts"], num_experts_per_tok=w["top_k"],
               n_group=w["n_group"], topk_group=w["topk_group"], scoring_func="sigmoid", topk_method="noaux_tc",
               norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    with torch.device(device), building_local_experts(slots):
        block = SparseMoeBlock(deepseek_routing(cfg), w["hidden"], w["moe_intermediate"], dtype, w["shared"])
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return block


def shard_of(block: SparseMoeBlock, experts: range) -> SparseMoeBlock:
    """The layer as an EP rank holding `experts` sees it: the same router and shared expert, the
    routed weights a view of `experts`' slices (no copy), every other expert's copies skipped."""
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    with torch.device("meta"):
        shard = SparseMoeBlock(block.routing, w13.shape[2], w2.shape[2], w13.dtype, 0, local_experts=experts)
    shard.gate, shard.shared_experts = block.gate, block.shared_experts
    shard.experts.w13_weight = nn.Parameter(w13[experts.start : experts.stop], requires_grad=False)
    shard.experts.w2_weight = nn.Parameter(w2[experts.start : experts.stop], requires_grad=False)
    return shard


@contextmanager
def kernel_backend(name: str):
    before = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median ms of `fn` (CUDA events on a GPU, the host clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def compute_rows(w: dict, batches: list[int], shards: list[int], device: torch.device, dtype: torch.dtype,
                 iters: int) -> list[dict]:  # fmt: skip
    """Per-layer times: the full layer (fused kernel where it runs, and grouped GEMM), router +
    shared alone, and each 1/N shard (every rank of N timed; the slowest one reported)."""
    block = moe_layer(w, device, dtype)
    E, k = w["experts"], w["top_k"]
    rows = []
    for T in batches:
        x = torch.randn(T, w["hidden"], device=device, generator=torch.Generator(device).manual_seed(T)).to(dtype)
        ids = _routed_ids(block, x)
        fused = "fused Triton kernel" if device.type == "cuda" else "torch (no CUDA)"
        full = time_ms(_call(block, x), device, iters)
        with kernel_backend("torch"):  # the grouped GEMM, as an EP rank runs its experts
            grouped = time_ms(_call(block, x), device, iters)
            fixed = time_ms(_call(shard_of(block, range(0)), x), device, iters)
            base = dict(tokens=T, full_fused_ms=full, full_grouped_ms=grouped)
            rows.append(base | dict(layer=f"full, {fused}", experts=E, copies=T * k, ms=full))
            rows.append(base | dict(layer="full, grouped GEMM", experts=E, copies=T * k, ms=grouped))
            rows.append(base | dict(layer="router + shared only", experts=0, copies=0, ms=fixed))
            for n in shards:
                S = E // n
                per_rank = [(time_ms(_call(shard_of(block, range(r * S, (r + 1) * S)), x), device, iters),
                             int(((ids >= r * S) & (ids < (r + 1) * S)).sum())) for r in range(n)]  # fmt: skip
                rows.append(base | dict(layer=f"EP{n} shard (slowest of {n} ranks)", experts=S,
                                        copies=statistics.mean(c for _, c in per_rank),
                                        copies_max=max(c for _, c in per_rank), ms=max(t for t, _ in per_rank),
                                        ms_mean=statistics.mean(t for t, _ in per_rank)))  # fmt: skip
    return rows


def _call(layer: nn.Module, x: torch.Tensor):
    return lambda: layer(x)


def _routed_ids(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    from deepinfer_core.models.layers.moe import select_experts

    return select_experts(block.router_logits(x), block.routing, block.gate.e_score_correction_bias)[1]


def _captured(fn, device: torch.device):
    """(graph, static outputs) of `fn` captured after two eager warm-up runs on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread may query its events while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    return torch.equal(a, b), float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


@torch.inference_mode()
def graph_check(group, w: dict, tokens: int, device: torch.device, dtype: torch.dtype, iters: int) -> dict:
    """The padded dispatch on `group`: (1) dispatch + combine of the routed token copies (a round
    trip: it must return exactly what was sent), (2) the whole EP layer (router, dispatch, the
    rank's experts by grouped GEMM over device counts, combine, weighted sum, shared expert),
    each eager and, on CUDA, captured in a CUDA graph and replayed, also on a second routing."""
    N, E = group.size, w["experts"]
    slots = list(range(group.rank * (E // N), (group.rank + 1) * (E // N)))
    block = moe_layer(w, device, dtype, slots=slots, seed=0)  # every rank: the same router and shared weights
    ep = apply_expert_parallel(nn.ModuleList([block]), group, dtype, backend="padded", max_tokens=tokens)
    disp, placement = ep.dispatcher, ep.placement
    gen = torch.Generator(device).manual_seed(1 + group.rank)
    x = torch.randn(tokens, w["hidden"], device=device, generator=gen).to(dtype)
    x2 = torch.randn(tokens, w["hidden"], device=device, generator=gen).to(dtype) * 3
    rows = torch.empty(tokens * w["top_k"], w["hidden"], device=device, dtype=dtype)
    counts = torch.empty(placement.num_slots, dtype=torch.int64, device=device)

    def route(h: torch.Tensor) -> None:  # rows sorted by physical slot and their counts, into the static inputs
        phys = placement.to_physical(0, _routed_ids(block, h), group.rank).reshape(-1)
        order = torch.argsort(phys, stable=True)
        rows.copy_(h[torch.arange(tokens, device=device).repeat_interleave(w["top_k"])[order]])
        counts.copy_(torch.bincount(phys, minlength=placement.num_slots))

    def round_trip() -> torch.Tensor:
        sent = disp.dispatch(rows, counts)
        return disp.combine(sent.hidden, sent.handle)

    static_x = x.clone()
    result = dict(world=N, backend=dist.get_backend(group.pg), tokens=tokens, rows_per_peer=disp.rows_per_peer)
    for name, fn, load, sent_back in (("dispatch + combine", round_trip, route, lambda h: rows),
                                      ("whole EP layer", lambda: block(static_x), static_x.copy_, None)):  # fmt: skip
        r = result.setdefault(name, {})
        load(x)
        eager = fn().clone()
        if sent_back is not None:
            r["round_trip_exact"] = torch.equal(eager, sent_back(x))
        r["eager_repeat"] = _close(eager, fn())[1]  # run-to-run difference of eager itself
        r["eager_ms"] = time_ms(fn, device, iters)
        if device.type != "cuda":
            r["graph"] = "not tried: CUDA graphs need a GPU"
            continue
        try:
            graph, out = _captured(fn, device)
        except Exception as e:  # report why it does not capture
            r["graph"] = f"capture failed: {type(e).__name__}: {str(e)[:400]}"
            torch.cuda.synchronize(device)
            continue
        graph.replay()
        torch.cuda.synchronize(device)
        r["graph"] = "captured"
        r["replay_equal"], r["replay_max_diff"] = _close(out, eager)
        load(x2)  # another routing, in place
        eager2 = fn().clone()
        graph.replay()
        torch.cuda.synchronize(device)
        r["replay2_equal"], r["replay2_max_diff"] = _close(out, eager2)
        if sent_back is not None:
            r["replay2_round_trip_exact"] = torch.equal(out, sent_back(x2))
        r["graph_ms"] = time_ms(graph.replay, device, iters)
        del graph
    block.ep = None
    return result


def _one_rank_group(backend: str):
    port = _free_port()
    return join_instance(0, 1, f"127.0.0.1:{port}", backend, join_timeout_s=30, collective_timeout_s=60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_child(rank: int, address: str, w: dict, tokens: int, iters: int, out) -> None:
    try:
        torch.cuda.set_device(0)  # both ranks on the one device
        group = join_instance(rank, 2, address, "nccl", join_timeout_s=30, collective_timeout_s=30)
        probe = torch.full((2,), float(rank), device="cuda")
        got = torch.empty_like(probe)
        dist.all_to_all_single(got, probe)
        torch.cuda.synchronize()
        out.put((rank, {"probe": got.tolist()} | graph_check(group, w, tokens, torch.device("cuda"),
                                                            torch.bfloat16, iters)))  # fmt: skip
        leave_instance()
    except Exception as e:
        out.put((rank, {"error": f"{type(e).__name__}: {str(e)[:600]}", "where": traceback.format_exc()[-600:]}))


def two_ranks_on_one_device(w: dict, tokens: int, iters: int, timeout_s: float) -> dict:
    """Two NCCL ranks (processes) on cuda:0: their results, or each one's error; killed past the deadline."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_two_rank_child, args=(r, address, w, tokens, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            rank, res = out.get(timeout=1.0)
            results[rank] = res
        except pyqueue.Empty:
            if not any(p.is_alive() for p in procs) and out.empty():
                break
    for rank in sorted({0, 1} - set(results)):
        code = procs[rank].exitcode
        results[rank] = {"error": f"no answer within {timeout_s:.0f} s" if code is None else f"exited with code {code}"}
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return results


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_compute(rows: list[dict]) -> None:
    print("| tokens | layer | experts held | token copies computed (mean; max) | ms | vs full (fused) "
          "| vs full (grouped GEMM) |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        copies = f"{r['copies']:.0f}" + (f"; {r['copies_max']}" if "copies_max" in r else "")
        ms = f"{r['ms']:.3f}" + (f" (mean {r['ms_mean']:.3f})" if "ms_mean" in r else "")
        print(f"| {r['tokens']} | {r['layer']} | {r['experts']} | {copies} | {ms} | "
              f"{_ratio(r['ms'], r['full_fused_ms'])} | {_ratio(r['ms'], r['full_grouped_ms'])} |")  # fmt: skip


def _equality(r: dict, key: str) -> str:
    return f"{r[key + '_equal']} (max diff {r[key + '_max_diff']:.3g})" if key + "_equal" in r else "-"


def print_graph(res: dict) -> None:
    print(f"padded dispatch over {res['backend']}, world of {res['world']} rank(s), {res['tokens']} tokens "
          f"({res['rows_per_peer']} rows per rank-to-rank block)")  # fmt: skip
    print("| path | eager ms | CUDA graph | replay ms | replay == eager | replay == eager, 2nd routing "
          "| round trip exact | eager run-to-run max diff |")  # fmt: skip
    print("|---|---:|---|---:|---|---|---|---:|")
    for name in ("dispatch + combine", "whole EP layer"):
        r = res[name]
        trip = r.get("round_trip_exact", "-"), r.get("replay2_round_trip_exact", "-")
        print(f"| {name} | {r['eager_ms']:.3f} | {r['graph']} | {r.get('graph_ms', float('nan')):.3f} | "
              f"{_equality(r, 'replay')} | {_equality(r, 'replay2')} | {trip[0]} / {trip[1]} | {r['eager_repeat']:.3g} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512], help="decode tokens per layer call")
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8], help="EP sizes N: a rank holds E/N experts")
    ap.add_argument("--graph-tokens", type=int, default=128, help="the padded dispatch's token bound")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--two-rank-timeout", type=float, default=30.0)
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip or shorten the two-rank try to end by then")
    ap.add_argument("--smoke", action="store_true", help="tiny widths; runs on CPU (gloo, no graph capture)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for wide_ep_gpu.json")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("wide_ep --gpu needs a CUDA device (torch.cuda.is_available() is False); "
                         "--smoke runs the same steps at tiny widths on CPU")  # fmt: skip
    w, device = (TINY if args.smoke else DSV3), torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__, widths=w,
                device=torch.cuda.get_device_name() if cuda else "cpu",
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None)  # fmt: skip
    print(json.dumps(info), flush=True)
    report = dict(info=info)

    def save() -> None:
        if args.out:
            with open(os.path.join(args.out, "wide_ep_gpu.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)

    start = t0 = time.monotonic()  # the graph check first: it is the one a timeout must not cut off
    try:  # a failure here is reported, and the compute part still runs
        group = _one_rank_group("nccl" if cuda else "gloo")
        try:
            report["graph"] = graph_check(group, w, args.graph_tokens, device, dtype, args.iters)
        finally:
            leave_instance()
        print(f"\nPadded dispatch, eager and CUDA graph ({time.monotonic() - t0:.0f} s)")
        print_graph(report["graph"])
    except Exception:
        report["graph_error"] = traceback.format_exc()
        print(f"\nPadded dispatch failed:\n{report['graph_error']}")
    if cuda:
        torch.cuda.empty_cache()
    save()
    t0 = time.monotonic()
    report["compute"] = compute_rows(w, args.batches, args.shards, device, dtype, args.iters)
    if cuda:
        torch.cuda.empty_cache()
    print(f"\nPer-layer MoE compute ({time.monotonic() - t0:.0f} s)", flush=True)
    print_compute(report["compute"])
    save()
    left = args.budget_s - (time.monotonic() - start) - 5 if args.budget_s else args.two_rank_timeout
    if cuda and left < 5:
        print(f"\nTwo NCCL ranks on one device: not tried ({left:.0f} s left of --budget-s)")
    elif cuda:  # two ranks on the one device: NCCL is expected to refuse them
        t0 = time.monotonic()
        timeout = min(args.two_rank_timeout, left)
        report["two_ranks"] = two_ranks_on_one_device(w, min(args.graph_tokens, 32), 5, timeout)
        print(f"\nTwo NCCL ranks on one device ({time.monotonic() - t0:.0f} s): "
              f"{json.dumps(report['two_ranks'], default=str)[:1500]}", flush=True)  # fmt: skip
        save()
