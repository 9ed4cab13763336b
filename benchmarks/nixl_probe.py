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

import numpy as np
import torch

MiB = 2**20


def _agent(name: str, num_threads: int = 0, progress_thread: bool = True):
    from nixl._api import nixl_agent, nixl_agent_config

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


def main() -> None:
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
    args = ap.parse_args()
    total_max = max(args.sizes_mib) * MiB
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
    local_mem = "VRAM" if args.src.startswith("cuda") else "DRAM"
    remote_mem = "VRAM" if args.dst.startswith("cuda") else "DRAM"
    local_dev = torch.device(args.src).index or 0

    def run_once(make) -> tuple[float, float, float]:
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

    print(f"# {args.label} {args.op} {args.src} -> {args.dst}, initiator thread {args.initiator_thread}", flush=True)
    print(f"{'MiB':>6} {'variant':<16} {'descs':>6} {'prepare us':>10} {'post us':>8} {'total ms':>9} "
          f"{'GB/s':>7} {'copy GB/s':>9} {'ratio':>6}")  # fmt: skip
    dst_local = None
    if args.dst.startswith("cuda") and args.src.startswith("cuda"):
        dst_local = torch.empty(total_max, dtype=torch.uint8, device=args.dst)
    for size_mib in args.sizes_mib:
        total = size_mib * MiB
        # reference: a plain copy of the same bytes (peer-to-peer on GPUs, memcpy on CPU)
        ref_dst = dst_local if dst_local is not None else torch.empty(total_max, dtype=torch.uint8)
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
        copy_t = statistics.median(times[1:])
        splits = [("whole", args.run_mib * MiB)] + [(f"{s:g}M", int(s * MiB)) for s in args.splits_mib]
        for tag, split in splits:
            split = min(split, total)
            ld = _descs(src.data_ptr(), total, split, local_dev)
            rd = _descs(remote_base, total, split, remote_dev)

            def make_init(ld=ld, rd=rd):
                return agent.initialize_xfer(
                    args.op, agent.get_xfer_descs(ld, local_mem), agent.get_xfer_descs(rd, remote_mem), peer
                )

            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(ld, local_mem))
            rp = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(rd, remote_mem))
            idx = np.arange(len(ld))

            def make_prep(lp=lp, rp=rp, idx=idx):
                return agent.make_prepped_xfer(args.op, lp, idx, rp, idx)

            def make_prep_n(lp=lp, rp=rp, idx=idx):
                parts = np.array_split(idx, min(args.concurrent, len(idx)))
                return [agent.make_prepped_xfer(args.op, lp, p, rp, p) for p in parts]

            variants = [(f"init/{tag}", make_init), (f"prep/{tag}", make_prep)]
            if args.concurrent > 1 and len(idx) > 1:
                variants.append((f"prep{args.concurrent}/{tag}", make_prep_n))
            if args.device_trace and tag == "whole":
                device_trace(lambda make=make_prep: run_once(make), ref_dst, src, total, args)
            for name, make in variants:
                run_once(make)  # warm-up (first use of a region maps it on the peer)
                runs = [run_once(make) for _ in range(args.reps)]
                prep = statistics.median(r[0] for r in runs)
                post = statistics.median(r[1] for r in runs)
                tot = statistics.median(r[2] for r in runs)
                print(
                    f"{size_mib:>6} {name:<16} {len(ld):>6} {prep * 1e6:>10.0f} {post * 1e6:>8.0f} {tot * 1e3:>9.3f} "
                    f"{total / tot / 1e9:>7.1f} {total / copy_t / 1e9:>9.1f} {copy_t / tot:>6.2f}",
                    flush=True,
                )
            agent.release_dlist_handle(lp)
            agent.release_dlist_handle(rp)
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
