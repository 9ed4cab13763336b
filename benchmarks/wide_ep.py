"""Wide-EP on CPU: decode step time and MoE all-to-all time per layer for EP 1/2/4 on the tiny
model, and the load imbalance before/after EPLB on a skewed synthetic load.

Each EP rank is a process (gloo) holding E/N experts and its own batch (DP attention), so an
EP=N instance decodes N times the tokens of EP=1 per step. All-to-all time is measured inside the
dispatcher (counts + rows + combine) and includes waiting for the slowest rank.

    python benchmarks/wide_ep.py [--ep 1 2 4] [--batch 8] [--steps 40]

GPU: pass `--device cuda` on a machine with N GPUs (`--backend nccl`); each rank takes cuda:<rank>.
On one GPU, `--gpu` runs `benchmarks/wide_ep_gpu.py` instead (its flags follow): the per-layer MoE
compute of a 1/N expert shard against the full layer at DeepSeek-V3 widths, and the padded
dispatch over NCCL eager and in a CUDA graph.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script: its sibling modules import as `benchmarks.X` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer_core.distributed.placement import ExpertPlacement, imbalance  # noqa: E402
from deepinfer_core.eplb.policy import rebalance  # noqa: E402
from deepinfer_core.sampling_params import SamplingParams  # noqa: E402


def _engine_kw(device: str, rank: int) -> dict:
    return dict(device=f"cuda:{rank}" if device == "cuda" else "cpu", dtype="float32", num_gpu_blocks=256,
                max_model_len=512, block_size=16)  # fmt: skip


def _add_batch(engine, batch: int, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", params=params, prompt_token_ids=torch.randint(3, 1000, (32,), generator=g).tolist())


def _measure(step, steps: int) -> list[float]:
    step()  # the prefill
    step()  # first decode (warm-up)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _rank(rank: int, ep: int, address: str, device: str, batch: int, steps: int, backend: str, queue) -> None:
    torch.set_num_threads(1)
    from deepinfer_core.distributed.group import join_instance, leave_instance

    group = join_instance(rank, ep, address, backend)
    try:
        queue.put((rank, _measure_rank(group, device, batch, steps)))
    finally:
        leave_instance()


def _measure_rank(group, device: str, batch: int, steps: int) -> dict:
    from deepinfer_core.distributed.lockstep import LockstepRank
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine_args import EngineArgs

    args = EngineArgs(expert_parallel_size=group.size, data_parallel_size=group.size, data_parallel_rank=group.rank,
                      **_engine_kw(device, group.rank))  # fmt: skip
    engine = LLMEngine.from_engine_args(args, group=group)
    _add_batch(engine, batch, steps, group.rank)
    lock = LockstepRank(engine, group)
    ep = engine.worker.ep
    comm0 = ep.dispatcher.comm_s
    times = _measure(lock.step, steps)
    comm = ep.dispatcher.comm_s - comm0
    lock.close()
    return {"step_s": sorted(times)[len(times) // 2], "a2a_s": comm / steps, "layers": len(ep.blocks)}


def run_ep(ep: int, device: str, batch: int, steps: int, backend: str) -> dict:
    if ep == 1:
        from deepinfer_core.engine.llm_engine import LLMEngine
        from deepinfer_core.engine_args import EngineArgs

        engine = LLMEngine.from_engine_args(EngineArgs(**_engine_kw(device, 0)))
        _add_batch(engine, batch, steps, 0)
        times = _measure(engine.step, steps)
        return {"step_s": sorted(times)[len(times) // 2], "a2a_s": 0.0, "layers": 2}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    procs = [ctx.Process(target=_rank, args=(r, ep, address, device, batch, steps, backend, queue)) for r in range(ep)]
    for p in procs:
        p.start()
    res = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    worst = max(res.values(), key=lambda r: r["step_s"])
    return {k: worst[k] for k in ("step_s", "layers")} | {"a2a_s": max(r["a2a_s"] for r in res.values())}


def skewed_load(layers: int, experts: int, seed: int = 0, zipf: float = 1.2) -> torch.Tensor:
    """[L, E] token counts: a Zipf popularity, shuffled per layer (hot experts land anywhere)."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** zipf
    return torch.stack([(base[torch.randperm(experts, generator=g)] * 1e5).round() for _ in range(layers)])


def eplb_rows() -> list[tuple]:
    rows = []
    for E, N, R, groups, nodes in [(8, 4, 0, 4, 2), (8, 4, 4, 4, 2), (256, 32, 0, 8, 4), (256, 32, 32, 8, 4),
                                   (256, 64, 64, 8, 8)]:  # fmt: skip
        load = skewed_load(4, E)
        before = imbalance(ExpertPlacement.contiguous(4, E, N, R).rank_load(load))
        for policy in ("global", "hierarchical"):
            after = imbalance(ExpertPlacement(rebalance(load, E + R, N, policy, groups, nodes), E, N).rank_load(load))
            rows.append((E, N, R, policy, before, after))
    return rows


def main() -> None:
    if "--gpu" in sys.argv[1:]:
        from benchmarks.wide_ep_gpu import main as gpu_main

        return gpu_main([a for a in sys.argv[1:] if a != "--gpu"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the one-GPU mode (benchmarks/wide_ep_gpu.py; see --gpu --help)")
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=8, help="decoding sequences per rank")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| EP | tokens/step | step ms (p50, slowest rank) | all-to-all ms/layer | all-to-all share |")
    print("|---|---|---|---|---|")
    for ep in args.ep:
        r = run_ep(ep, args.device, args.batch, args.steps, args.backend)
        share = r["a2a_s"] / r["step_s"] if r["step_s"] else 0.0
        print(f"| {ep} | {ep * args.batch} | {r['step_s'] * 1e3:.2f} | {r['a2a_s'] / r['layers'] * 1e3:.3f} | "
              f"{share:.0%} |")  # fmt: skip
    print()
    print("| experts | ranks | redundant | policy | imbalance before | after |")
    print("|---|---|---|---|---|---|")
    for E, N, R, policy, before, after in eplb_rows():
        print(f"| {E} | {N} | {R} | {policy} | {before:.3f} | {after:.3f} |")


if __name__ == "__main__":
    main()
