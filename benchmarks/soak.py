"""Soak: S concurrent streams against a running cluster for D seconds, every request checked (none
lost: each must end by length, `ignore_eos` asks for all its tokens), and the resident memory of every
process (head, each engine) sampled along the way, reported with its slope after the warm-up.

    python benchmarks/soak.py --streams 256 --minutes 10            # starts 1 PE + 1 CE on the tiny model
    python benchmarks/soak.py --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051 --streams 64 --minutes 3

A flat slope after warm-up is what "no leak" looks like; `tests/e2e/test_soak.py` runs a short one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: the repository's packages import from its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class SoakResult:
    requests: int = 0
    lost: list[str] = field(default_factory=list)
    """Requests that failed or ended short, with why."""
    rss_mb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """process -> (seconds since start, resident MB) samples."""
    anon_mb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """process -> (seconds since start, resident anonymous MB) samples: the heaps alone. Resident
    file pages (shared libraries' code as new paths first run, mapped files) grow too, and are no leak."""

    def slopes(self, warmup_s: float, series: dict | None = None) -> dict[str, float]:
        """process -> MB per minute after `warmup_s` (least squares) of `series` (default: resident)."""
        out = {}
        for name, samples in (self.rss_mb if series is None else series).items():
            pts = [(t, mb) for t, mb in samples if t >= warmup_s]
            if len(pts) < 3:
                continue
            mt = sum(t for t, _ in pts) / len(pts)
            mm = sum(mb for _, mb in pts) / len(pts)
            var = sum((t - mt) ** 2 for t, _ in pts) or 1.0
            out[name] = 60.0 * sum((t - mt) * (mb - mm) for t, mb in pts) / var
        return out

    def table(self, warmup_s: float) -> str:
        slopes, anon = self.slopes(warmup_s), self.slopes(warmup_s, self.anon_mb)
        rows = [
            f"{'process':<12} {'first MB':>9} {'last MB':>9} {'MB/min after warm-up':>21}"
            f" {'anon first':>11} {'anon last':>10} {'anon MB/min':>12}"
        ]
        for name, samples in sorted(self.rss_mb.items()):
            slope = f"{slopes[name]:+.2f}" if name in slopes else "-"
            a = self.anon_mb.get(name) or [(0.0, 0.0)]
            a_slope = f"{anon[name]:+.2f}" if name in anon else "-"
            rows.append(
                f"{name:<12} {samples[0][1]:>9.1f} {samples[-1][1]:>9.1f} {slope:>21}"
                f" {a[0][1]:>11.1f} {a[-1][1]:>10.1f} {a_slope:>12}"
            )
        return "\n".join(rows)


def _memory_mb(pid: int) -> tuple[float, float]:
    """(resident, resident anonymous) MB of `pid`."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "RssAnon:")):
            got[line.split(":")[0]] = int(line.split()[1]) / 1024
    return got.get("VmRSS", 0.0), got.get("RssAnon", 0.0)


def processes(grpc_address: str, head_pid: int) -> dict[str, int]:
    """name -> pid of the head and of every engine the cluster lists."""
    import grpc

    from deepinfer_proto import common_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(grpc_address) as ch:
        status = gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
    pids = {"head": head_pid} if head_pid else {}
    pids.update({w.info.worker_id: w.info.pid for p in status.pools for w in p.workers})
    return pids


def _sample(result: SoakResult, pids: dict[str, int], began: float, stop: threading.Event, every_s: float) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            try:
                rss, anon = _memory_mb(pid)
            except OSError:  # the process is gone: its series just ends
                continue
            t = time.monotonic() - began
            result.rss_mb.setdefault(name, []).append((t, rss))
            result.anon_mb.setdefault(name, []).append((t, anon))
        stop.wait(every_s)


async def _client(url: str, i: int, max_tokens: int, until: float, result: SoakResult) -> None:
    body = {"prompt": f"soak {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < until:
            result.requests += 1
            reason, error = None, None
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                error = chunk["error"]["message"]
                                continue
                            reason = chunk["choices"][0]["finish_reason"] or reason
            except httpx.HTTPError as e:
                error = repr(e)
            if error or reason != "length":
                result.lost.append(f"stream {i}: {error or reason}")


def soak(
    url: str, grpc_address: str, streams: int, seconds: float, max_tokens: int = 32, head_pid: int = 0
) -> SoakResult:
    """Run the soak and return what it saw (`url`: the gateway's HTTP root)."""
    result = SoakResult()
    began = time.monotonic()
    stop = threading.Event()
    sampler = threading.Thread(
        target=_sample, args=(result, processes(grpc_address, head_pid), began, stop, max(1.0, seconds / 30))
    )
    sampler.start()

    async def run():
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(url, i, max_tokens, until, result) for i in range(streams)))

    try:
        asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the gateway's HTTP root (default: start a cluster of 1 PE + 1 CE)")
    p.add_argument("--grpc", help="the gateway's gRPC address (with --url)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument(
        "--no-kv-store",
        action="store_true",
        help="start the cluster without its KV store: a CE's host pool (L2, 256 MiB) takes resident memory "
        "as it fills with saved blocks, which reads as growth until it is full",
    )
    args = p.parse_args()
    serve = None
    if args.url is None:
        from tests.helpers.cluster import SMALL_ENGINE, ServeProcess

        store = ["--no-kv-store"] if args.no_kv_store else []
        serve = ServeProcess(*SMALL_ENGINE, "--max-num-seqs", str(max(256, args.streams)), *store)
        args.url, args.grpc = serve.url, serve.grpc_address
    try:
        head_pid = serve.proc.pid if serve else 0
        result = soak(args.url, args.grpc, args.streams, args.minutes * 60, args.max_tokens, head_pid)
    finally:
        if serve is not None:
            serve.stop()
    print(f"{result.requests} requests over {args.minutes:g} min with {args.streams} streams; lost {len(result.lost)}")
    print(result.table(args.warmup_s))
    per_min = result.requests / args.minutes
    anon = result.slopes(args.warmup_s, result.anon_mb)
    print("anon MB per 1,000 requests after warm-up: " + ", ".join(
        f"{name} {1000 * slope / per_min:+.3f}" for name, slope in sorted(anon.items())))  # fmt: skip
    for line in result.lost[:10]:
        print("lost:", line)
    return 1 if result.lost else 0


if __name__ == "__main__":
    sys.exit(main())
