"""Raw NIXL WRITE bandwidth between two processes, by descriptor split and API path, beside a
plain copy of the same bytes — the experiment behind the transfer plane's descriptor sizing.

The initiator (this process) writes into a buffer registered by a second process, as a PE writes
into a CE. Variants, all in one run:
  * `init/<split>`: `initialize_xfer` with the payload cut into descriptors of `<split>` bytes
    (`whole` = one descriptor per layer-sized run of `--run-mib`);
  * `prep/<split>`: descriptor lists prepared once (`prep_xfer_dlist`) and a transfer made from
    indices (`make_prepped_xfer`), the way a long-lived engine can address blocks;
  * `prepN/<split>`: the same payload as N transfers posted together (N = `--concurrent`).
`--op READ` makes the initiator pull the bytes from the peer instead of pushing them (the data
then flows dst -> src, and the copy reference runs that way too).
Columns: prepare = building the request, post = `transfer()`, wait = post to DONE, GB/s of
the whole, and ratio = copy time / whole time.

    python benchmarks/nixl_probe.py --src cuda:0 --dst cuda:1      # GPU0 -> GPU1 VRAM
    python benchmarks/nixl_probe.py                                 # CPU DRAM -> DRAM
    python benchmarks/nixl_probe.py --src cuda:0 --dst cuda:1 --initiator-thread off
                                          # the writer polls its transfers itself, as a GPU PE does
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MiB = 2**20


def _agent(name: str, num_threads: int = 0, progress_thread: bool = True):
    from deepinfer_core.transfer.nixl_variant import api

    nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config

    config = nixl_agent_config(backends=["UCX"], num_threads=num_threads, enable_prog_thread=progress_thread)
    return nixl_agent(name, config)


def _target(device: str, nbytes: int, num_threads: int, conn) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    agent = _agent("probe-target", num_threads)
    agent.register_memory(buf)
    dev = torch.device(device)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev.index or 0))
    conn.recv()  # "done"


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def _descs(base: int, total: int, split: int, dev: int) -> np.ndarray:
    offs = np.arange(0, total, split, dtype=np.uint64)
    sizes = np.minimum(split, total - offs).astype(np.uint64)
    return np.stack([base + offs, sizes, np.full_like(offs, dev)], axis=1)


@dataclass
class Link:
    """The initiator's agent, its source buffer and what it knows of the peer's registered buffer."""

    agent: Any
    peer: str
    src: torch.Tensor
    remote_base: int
    remote_dev: int
    local_mem: str
    remote_mem: str
    local_dev: int


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="cpu")
    ap.add_argument("--dst", default="cpu")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--run-mib", type=int, default=64, help="bytes of one layer's coalesced run in the engine")
    ap.add_argument("--splits-mib", type=float, nargs="+", default=[16, 4, 1])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--num-threads", type=int, default=0, help="UCX workers of each agent (0: NIXL's default)")
    ap.add_argument("--label", default="")
    ap.add_argument("--op", choices=["WRITE", "READ"], default="WRITE")
    ap.add_argument("--concurrent", type=int, default=4, help="transfers a prepN variant splits the payload into")
    ap.add_argument(
        "--device-trace",
        action="store_true",
        help="record one prepared WRITE of each size (and the copy) with the CUDA profiler and print the "
        "device copies they ran: how many, their bytes and device time",
    )
    ap.add_argument(
        "--initiator-thread",
        choices=["on", "off"],
        default="on",
        help="NIXL's progress thread in this process (on: nixl's Python default, spinning); the peer keeps its own",
    )
    return ap.parse_args()


def _connect(args: argparse.Namespace, total_max: int):
    """Start the target process, register the source buffer and connect to the target's agent.
    Returns the link, the pipe to the target and its process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(args.dst, total_max, args.num_threads, child), daemon=True)
    proc.start()
    meta, remote_base, remote_dev = parent.recv()
    src = torch.empty(total_max, dtype=torch.uint8, device=args.src)
    src.fill_(7)
    agent = _agent("probe-initiator", args.num_threads, progress_thread=args.initiator_thread == "on")
    agent.register_memory(src)
    peer = agent.add_remote_agent(meta)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    agent.make_connection(peer)
    mem = {True: "VRAM", False: "DRAM"}
    link = Link(agent, peer, src, remote_base, remote_dev, mem[args.src.startswith("cuda")],
                mem[args.dst.startswith("cuda")], torch.device(args.src).index or 0)  # fmt: skip
    return link, parent, proc


def _run_once(agent, make) -> tuple[float, float, float]:
    """(prepare, post, whole) seconds of one transfer (or one batch of them) made by `make`."""
    t0 = time.perf_counter()
    made = make()
    handles = made if isinstance(made, list) else [made]
    t1 = time.perf_counter()
    states = [agent.transfer(h) for h in handles]
    t2 = time.perf_counter()
    for h, state in zip(handles, states):
        while state != "DONE":
            state = agent.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("transfer failed")
    t3 = time.perf_counter()
    for h in handles:
        agent.release_xfer_handle(h)
    return t1 - t0, t2 - t1, t3 - t0


def _copy_seconds(args: argparse.Namespace, src: torch.Tensor, ref_dst: torch.Tensor, total: int) -> float:
    """Median time of a plain copy of the same bytes (peer-to-peer on GPUs, memcpy on CPU)."""
    times = []
    for _ in range(args.reps + 1):
        _sync(args.src, args.dst)
        t = time.perf_counter()
        if args.op == "WRITE":
            ref_dst[:total].copy_(src[:total])
        else:  # the bytes flow from the peer's device to the initiator's
            src[:total].copy_(ref_dst[:total])
        _sync(args.src, args.dst)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _variants(link: Link, args: argparse.Namespace, total: int, split: int):
    """The ways to post `total` bytes cut into descriptors of `split` bytes: [(name, make)], the
    descriptor count and the prepared lists (to release once the variants have run)."""
    agent, op = link.agent, args.op
    ld = _descs(link.src.data_ptr(), total, split, link.local_dev)
    rd = _descs(link.remote_base, total, split, link.remote_dev)

    def make_init():
        local, remote = agent.get_xfer_descs(ld, link.local_mem), agent.get_xfer_descs(rd, link.remote_mem)
        return agent.initialize_xfer(op, local, remote, link.peer)

    lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(ld, link.local_mem))
    rp = agent.prep_xfer_dlist(link.peer, agent.get_xfer_descs(rd, link.remote_mem))
    idx = np.arange(len(ld))

    def make_prep():
        return agent.make_prepped_xfer(op, lp, idx, rp, idx)

    def make_prep_n():
        parts = np.array_split(idx, min(args.concurrent, len(idx)))
        return [agent.make_prepped_xfer(op, lp, p, rp, p) for p in parts]

    variants = [("init", make_init), ("prep", make_prep)]
    if args.concurrent > 1 and len(idx) > 1:
        variants.append((f"prep{args.concurrent}", make_prep_n))
    return variants, len(ld), (lp, rp)


def _probe_size(link: Link, args: argparse.Namespace, size_mib: int, ref_dst: torch.Tensor) -> None:
    """One row per split and variant for a payload of `size_mib`, beside a plain copy of it."""
    total = size_mib * MiB
    copy_t = _copy_seconds(args, link.src, ref_dst, total)
    splits = [("whole", args.run_mib * MiB)] + [(f"{s:g}M", int(s * MiB)) for s in args.splits_mib]
    for tag, split in splits:
        variants, descs, dlists = _variants(link, args, total, min(split, total))
        if args.device_trace and tag == "whole":
            prep = dict(variants)["prep"]
            device_trace(lambda make=prep: _run_once(link.agent, make), ref_dst, link.src, total, args)
        for kind, make in variants:
            _run_once(link.agent, make)  # warm-up (first use of a region maps it on the peer)
            runs = [_run_once(link.agent, make) for _ in range(args.reps)]
            prep_s, post, tot = (statistics.median(r[i] for r in runs) for i in range(3))
            print(
                f"{size_mib:>6} {kind + '/' + tag:<16} {descs:>6} {prep_s * 1e6:>10.0f} {post * 1e6:>8.0f} "
                f"{tot * 1e3:>9.3f} {total / tot / 1e9:>7.1f} {total / copy_t / 1e9:>9.1f} {copy_t / tot:>6.2f}",
                flush=True,
            )
        for handle in dlists:
            link.agent.release_dlist_handle(handle)


def main() -> None:
    args = _parse_args()
    total_max = max(args.sizes_mib) * MiB
    link, parent, proc = _connect(args, total_max)
    print(f"# {args.label} {args.op} {args.src} -> {args.dst}, initiator thread {args.initiator_thread}", flush=True)
    print(f"{'MiB':>6} {'variant':<16} {'descs':>6} {'prepare us':>10} {'post us':>8} {'total ms':>9} "
          f"{'GB/s':>7} {'copy GB/s':>9} {'ratio':>6}")  # fmt: skip
    dst_local = None
    if args.dst.startswith("cuda") and args.src.startswith("cuda"):
        dst_local = torch.empty(total_max, dtype=torch.uint8, device=args.dst)
    for size_mib in args.sizes_mib:
        # reference: a plain copy of the same bytes (peer-to-peer on GPUs, memcpy on CPU)
        ref_dst = dst_local if dst_local is not None else torch.empty(total_max, dtype=torch.uint8)
        _probe_size(link, args, size_mib, ref_dst)
    parent.send("done")
    proc.join(timeout=10)


def device_trace(write, ref_dst, src, total: int, args) -> None:
    """One WRITE and one plain copy under the CUDA profiler (process-wide: it also sees the copies
    UCX issues): device time against wall time tells the transport's copy from its host-side costs."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    write()  # warm-up outside the trace
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in (("write", write), ("copy", lambda: ref_dst[:total].copy_(src[:total]))):
            _sync(args.src, args.dst)
            with record_function(name):
                fn()
                _sync(args.src, args.dst)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    for name in ("write", "copy"):
        span = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == name)
        t0, t1 = span["ts"], span["ts"] + span["dur"]
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and t0 <= e["ts"] <= t1]
        if not copies:
            print(f"# trace {name}: no device copies recorded (host memory?)")
            continue
        busy = sum(e["dur"] for e in copies)
        moved = sum(e["args"].get("bytes", 0) for e in copies)
        print(
            f"# trace {name} {total / MiB:.0f} MiB: {len(copies)} device copies, {moved / MiB:.0f} MiB, "
            f"device time {busy / 1e3:.3f} ms ({moved / busy / 1e3:.1f} GB/s), span with host sync {span['dur'] / 1e3:.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
