"""The KV store under a shared-prefix workload, on and off in one run, and its tiers' load bandwidth.

Workload: G groups x P prompts, each prompt its group's long common prefix plus a short suffix of
its own, sent round-robin over the groups (a group comes back only after every other group has
been seen) in windows of C concurrent requests, through one PE and one CE in their own processes
(`pd_harness`). The PE's KV cache is small, so its own prefix cache (L1) cannot hold every group:
without the store it computes a group's prefix again each time it comes back; with the store the
CE's saves are there to load (L3 the first time, then L2 once promoted). Each configuration starts
fresh processes on a fresh directory: the store begins empty and fills during the run.

TTFT is the PE's: from a request's submission (reserve + prefill) to its hand-off result (first
token sampled, KV written to the CE), read by polling the PE. "computed" counts prompt tokens its
prefill steps ran; "hit rate" the prompt tokens it did not compute, by tier.

Bandwidth: a store over a KV cache on `--device` (blocks of `--layers` x `--block-tokens` x
`--width` fp32), with 'memcpy' the plain copy of the same bytes between the same memories:
    L2 save   KV blocks -> host pool slots (what `do_save_kvcache` waits for)
    L2 load   host pool slots -> KV blocks
    L3 write  sealing (checksum) + file write of staged slots, on the I/O thread
    L3 read   file -> slots through the file mover only (NIXL POSIX, or plain I/O)
    L3 load   lookup + read + verify + copy into KV blocks, from a store whose pool is empty
Files are read back from the page cache (just written), so L3 figures are memory-bound, not disk's.
With `--kv-store-url s3://bucket/prefix` (and `--kv-store-endpoint`), L3 is that bucket through
NIXL's OBJ backend instead: "L3 read" is then the GETs alone, and the figures are the endpoint's
(a local test server such as moto measures the server, not S3).

    python benchmarks/kv_store.py                       # both parts, CPU
    python benchmarks/kv_store.py --skip-workload --device cuda --backend FILE
    python benchmarks/kv_store.py --skip-workload --kv-store-url s3://kv/bench --kv-store-endpoint http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: its sibling modules import as `benchmarks.X` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pd_harness import EngineProcess  # noqa: E402
from deepinfer_core.config import KVStoreConfig  # noqa: E402
from deepinfer_core.kvstore import block_copy, frame  # noqa: E402
from deepinfer_core.kvstore.store import KVStore  # noqa: E402
from deepinfer_core.roles import EngineType  # noqa: E402
from deepinfer_core.sampling_params import SamplingParams  # noqa: E402
from deepinfer_core.transfer.layout import KVLayout  # noqa: E402


# ---- the workload ------------------------------------------------------------------------------
def _prompts(groups: int, per_group: int, prefix: int, suffix: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    heads = [torch.randint(0, 1000, (prefix,), generator=g).tolist() for _ in range(groups)]
    return [
        heads[k] + torch.randint(0, 1000, (suffix,), generator=g).tolist()
        for _ in range(per_group)
        for k in range(groups)
    ]


def _start(engine_args: dict, store: KVStoreConfig | None, pe_blocks: int) -> tuple[EngineProcess, EngineProcess]:
    extra = {"kv_store": store} if store is not None else {}
    ce = EngineProcess(EngineType.COMPLETION, {**engine_args, **extra, "stop_preempted_request": True})
    pe = EngineProcess(EngineType.PROMPT, {**engine_args, **extra, "num_gpu_blocks": pe_blocks})
    pe.call("connect_peer", ce.info["agent_name"], ce.info["agent_metadata"], ce.info["kv_region"])
    return pe, ce


def _window(pe: EngineProcess, ce: EngineProcess, prompts: list[list[int]], params, first_id: int) -> list[float]:
    """Submit a window of requests, wait for all; the TTFT of each."""
    sent, ttft, ids = {}, {}, []
    for i, prompt in enumerate(prompts):
        rid = f"w{first_id + i}"
        ids.append(rid)
        target = ce.call("reserve", rid, params, prompt, 60.0)
        sent[rid] = time.perf_counter()
        pe.call("add_prefill", rid, target, params, prompt)
    finished: set[str] = set()
    deadline = time.monotonic() + 300
    while len(ttft) < len(ids) or len(finished) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError("the window did not finish")
        _, results = pe.call("collect")
        now = time.perf_counter()
        for r in results:
            if not r.ok:
                raise RuntimeError(f"hand-off of {r.request_id} failed: {r.error}")
            ttft[r.request_id] = now - sent[r.request_id]
        outs, _ = ce.call("collect")
        finished.update(o.request_id for o in outs if o.finished)
        time.sleep(0.0005)
    return [ttft[r] for r in ids]


def _wait_idle(engine: EngineProcess) -> None:
    deadline = time.monotonic() + 60
    while (stats := engine.call("kv_store_stats")) and (stats["inflight_saves"] or stats["l2_pins"]):
        if time.monotonic() > deadline:
            raise TimeoutError("the store did not go idle")
        time.sleep(0.005)


def run_workload(args, store_on: bool) -> dict:
    engine_args = dict(device="cpu", max_model_len=args.prefix + args.suffix + 64, block_size=args.block_size)
    engine_args.update(num_gpu_blocks=args.ce_blocks, max_num_batched_tokens=4096)
    prompts = _prompts(args.groups, args.per_group, args.prefix, args.suffix)
    with tempfile.TemporaryDirectory(prefix="kv-store-bench-") as directory:
        store = KVStoreConfig(directory=directory, l2_bytes=args.l2_mib << 20, l3_bytes=1 << 30) if store_on else None
        pe, ce = _start(engine_args, store, args.pe_blocks)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            _window(pe, ce, [prompts[-1][: args.suffix]], params, -1)  # warm-up: first forward, connection
            base = pe.call("stats")
            ttfts = []
            for start in range(0, len(prompts), args.concurrency):
                ttfts += _window(pe, ce, prompts[start : start + args.concurrency], params, start)
                if store_on:
                    _wait_idle(ce)  # a window's saves land before the next window looks them up
            stats = pe.call("stats")
        finally:
            pe.close()
            ce.close()
    kv = stats["kv_store"] or {}
    total = sum(len(p) for p in prompts)
    return dict(
        name="store on" if store_on else "store off",
        ttft=np.array(ttfts) * 1e3,
        computed=stats["computed_prompt_tokens"] - base["computed_prompt_tokens"],
        total=total,
        l1=stats["prefix_hit_tokens"] - base["prefix_hit_tokens"],
        l2=kv.get("hit_tokens_l2", 0),
        l3=kv.get("hit_tokens_l3", 0),
        load_s=kv.get("load_seconds", 0.0),
        loads=kv.get("loads", 0),
    )


def print_workload(rows: list[dict], args) -> None:
    print(
        f"\nShared-prefix workload: {args.groups} groups x {args.per_group} prompts, prefix {args.prefix} + "
        f"suffix {args.suffix} tokens, {args.concurrency} concurrent, PE KV cache {args.pe_blocks} blocks "
        f"of {args.block_size} tokens, tiny built-in model on CPU\n"
    )
    print(
        "| store | TTFT p50 / p99 (ms), all | p50 / p99, a group's first prompt | p50 / p99, the others "
        "| prompt tokens computed | hit rate (L1 / L2 / L3) | mean load (ms) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        t, ttft = r["total"], r["ttft"]
        hit = (t - r["computed"]) / t
        tiers = f"{hit:.1%} ({r['l1'] / t:.1%} / {r['l2'] / t:.1%} / {r['l3'] / t:.1%})"
        load = f"{r['load_s'] / r['loads'] * 1e3:.2f}" if r["loads"] else "-"
        cells = " | ".join(_p50_p99(x) for x in (ttft, ttft[: args.groups], ttft[args.groups :]))
        print(f"| {r['name']} | {cells} | {r['computed']:,} of {t:,} | {tiers} | {load} |")


def _p50_p99(ms: np.ndarray) -> str:
    return f"{np.percentile(ms, 50):.1f} / {np.percentile(ms, 99):.1f}"


# ---- tier bandwidth ----------------------------------------------------------------------------
def _timed(fn, repeat: int = 5) -> float:
    """Best of `repeat` wall times of fn() (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _store(directory: str, kv: torch.Tensor, args, l2_bytes: int) -> KVStore:
    layout = KVLayout.of({"architectures": ["Bench"]}, kv, kv.shape[2])
    if args.kv_store_url:
        config = KVStoreConfig(
            url=args.kv_store_url, endpoint=args.kv_store_endpoint, l2_bytes=l2_bytes, l3_bytes=1 << 34
        )
    else:
        config = KVStoreConfig(directory=directory, l2_bytes=l2_bytes, l3_bytes=1 << 34, backend=args.backend)
    return KVStore(config, kv, layout, b"bench-namespace!", "bench")


def _pool_bytes(n: int, kv: torch.Tensor) -> int:
    """A host pool of n + 1 slots for blocks of `kv`."""
    return (n + 1) * (kv.shape[0] * kv[0, 0].numel() * kv.element_size() + 2 * frame.HEADER_BYTES)


def _settle(store: KVStore) -> None:
    while store.io.pending:
        store.poll(wait_s=0.001)


def run_bandwidth(args) -> list[tuple[str, float, float]]:
    """(what, GB/s, memcpy GB/s of the same bytes between the same memories)."""
    device = torch.device(args.device)
    n = args.blocks
    kv = torch.randn((args.layers, 2 * n + 1, args.block_tokens, args.width), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-store-bw-") as directory:
        store = _store(directory, kv, args, l2_bytes=_pool_bytes(n, kv))
        nbytes = n * store.pool.payload_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def memcpy_to_host():
            host.copy_(dev, non_blocking=True)
            sync()

        def memcpy_to_kv():
            dev.copy_(host, non_blocking=True)
            sync()

        to_host, to_kv = nbytes / _timed(memcpy_to_host) / 1e9, nbytes / _timed(memcpy_to_kv) / 1e9
        blocks, slots = list(range(n)), store.pool.stage(n)

        def l2_save():
            event = block_copy.blocks_to_slots(kv, blocks, store.pool, slots)
            if event is not None:
                event.synchronize()

        rows.append(("L2 save (KV -> pool)", nbytes / _timed(l2_save) / 1e9, to_host))
        rows.append(
            (
                "L2 load (pool -> KV)",
                nbytes / _timed(lambda: block_copy.slots_to_blocks(store.pool, slots, kv, blocks)) / 1e9,
                to_kv,
            )
        )
        store.pool.unpin(slots)
        keys = [i.to_bytes(16, "little") for i in range(n)]
        start = time.perf_counter()
        store.save(keys, blocks)
        _settle(store)
        where = "object" if args.kv_store_url else "file"
        rows.append(
            (f"L3 write (seal + {where})", n * store.pool.frame_bytes / (time.perf_counter() - start) / 1e9, to_host)
        )
        rows += _l3_reads(directory, kv, args, keys, nbytes, to_kv)
        torch.testing.assert_close(kv[:, n : 2 * n], kv[:, :n], rtol=0, atol=0)  # what was loaded is what was saved
        store.close()
    return rows


def _l3_reads(directory: str, kv: torch.Tensor, args, keys: list[bytes], nbytes: int, to_kv: float) -> list:
    n = len(keys)
    reader = _store(directory, kv, args, l2_bytes=_pool_bytes(n, kv))
    slots = reader.pool.stage(n)
    if args.kv_store_url:  # GETs of the objects into the slots
        fds, items = [], [reader.tier._item(s, k) for s, k in zip(slots, keys)]
    else:
        fds = [os.open(reader.tier.path_of(k), os.O_RDONLY) for k in keys]
        items = [reader.tier.transfer_item(s, fd) for s, fd in zip(slots, fds)]
    raw = _timed(lambda: reader.tier.io.read(items, 60.0))
    checks = _timed(lambda: [frame.verify(reader.pool.frame(s), k, reader.namespace) for s, k in zip(slots, keys)])
    for fd in fds:
        os.close(fd)
    reader.pool.unpin(slots)
    host_bytes = n * reader.pool.frame_bytes
    start = time.perf_counter()
    tiers = reader.lookup(keys)
    load = reader.start_load(keys, tiers)
    while not load.done:
        reader.poll(wait_s=0.001)
    placed = reader.finish_load(load, list(range(n, 2 * n)))
    seconds = time.perf_counter() - start
    assert placed == n, f"placed {placed} of {n} blocks"
    reader.close()
    return [
        (
            f"L3 read ({reader.tier.io.name}, {'object' if args.kv_store_url else 'file'} -> pool)",
            host_bytes / raw / 1e9,
            to_kv,
        ),
        (f"checksum verify ({_algorithm()})", host_bytes / checks / 1e9, to_kv),
        ("L3 load (lookup + read + verify + copy)", nbytes / seconds / 1e9, to_kv),
    ]


def _algorithm() -> str:
    return "XXH3-128" if frame.default_algorithm() == 2 else "blake2b-128"


def print_bandwidth(rows, args) -> None:
    mib = args.blocks * args.layers * args.block_tokens * args.width * 4 / 2**20
    print(
        f"\nTier bandwidth: {args.blocks} blocks of {args.layers} layers x {args.block_tokens} tokens x {args.width} fp32 "
        f"({mib:.0f} MiB), KV cache on {args.device}, L3 {args.kv_store_url or 'files, backend ' + args.backend}\n"
    )
    print("| path | GB/s | memcpy GB/s | of memcpy |")
    print("|---|---:|---:|---:|")
    for what, gbs, ref in rows:
        print(f"| {what} | {gbs:.2f} | {ref:.2f} | {gbs / ref:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pe-blocks", type=int, default=200, help="the PE's KV cache: smaller than every group's prefix")
    ap.add_argument("--ce-blocks", type=int, default=512)
    ap.add_argument("--l2-mib", type=int, default=256)
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--device", default="cpu", help="bandwidth part: where the KV cache lives")
    ap.add_argument("--backend", default="POSIX", choices=["POSIX", "FILE"])
    ap.add_argument("--kv-store-url", default=None, help="bandwidth part: L3 in this bucket (s3://bucket/prefix)")
    ap.add_argument("--kv-store-endpoint", default=None, help="the bucket's S3-compatible endpoint")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    if not args.skip_workload:
        print_workload([run_workload(args, store_on=False), run_workload(args, store_on=True)], args)
    if not args.skip_bandwidth:
        print_bandwidth(run_bandwidth(args), args)


if __name__ == "__main__":
    main()
