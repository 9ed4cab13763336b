"""Serving latency on the embedded model: disaggregated (1 PE + 1 CE) vs `--colocated` (1 NORMAL
engine), both started by `deepinfer serve` on this machine in one run, driven over HTTP (SSE).

For each concurrency it prints time to first token (TTFT) and time per output token (TPOT),
medians over the requests, and the ratio disaggregated / colocated. Then the overhead of the
front door: a request through gateway -> router -> worker (colocated cluster, one at a time)
against the same request run by an in-process engine (the P/D cluster stopped by then).

    python benchmarks/serving.py [--concurrency 1 8 32] [--requests-per-level 3] [--prompt-len 64] [--new 32]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.cluster import ServeProcess  # noqa: E402

ENGINE = ["--num-blocks", "2048", "--block-size", "16", "--max-model-len", "1024"]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], new: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.perf_counter()
            first = first or now
            last = now
    return first - start, (last - first) / max(1, new - 1)


async def level(url: str, concurrency: int, rounds: int, prompt_len: int, new: int) -> tuple[float, float]:
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(prompt_len)] for i in range(concurrency * rounds)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, prompts[0], 4)  # warm the path
        results = []
        for r in range(rounds):
            batch = prompts[r * concurrency : (r + 1) * concurrency]
            results += await asyncio.gather(*(one_request(client, url, p, new) for p in batch))
    return statistics.median(t for t, _ in results), statistics.median(t for _, t in results)


def overhead(url: str, prompt_len: int, new: int, repeats: int) -> tuple[float, float]:
    """Median end-to-end seconds of one non-streamed request: through the cluster, and in-process."""
    from deepinfer_core import LLM, SamplingParams

    prompt = [(3 * j) % 1000 + 1 for j in range(prompt_len)]
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/completions", json=body)
        served = []
        for _ in range(repeats):
            t = time.perf_counter()
            assert client.post(f"{url}/v1/completions", json=body).status_code == 200
            served.append(time.perf_counter() - t)
    import torch

    torch.set_num_threads(1)  # as the workers run
    llm = LLM(max_model_len=1024, num_gpu_blocks=256, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([prompt], params)
    local = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([prompt], params)
        local.append(time.perf_counter() - t)
    return statistics.median(served), statistics.median(local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-level", type=int, default=3, help="rounds of `concurrency` requests")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=32, help="output tokens per request")
    parser.add_argument("--overhead-repeats", type=int, default=20)
    args = parser.parse_args()

    print("starting the colocated cluster (1 NORMAL engine) ...", flush=True)
    co = ServeProcess("--colocated", *ENGINE)
    print("starting the disaggregated cluster (1 PE + 1 CE) on the same Ray ...", flush=True)
    pd = ServeProcess("--ray-address", co.ray_address, *ENGINE)
    try:
        rows = []
        for c in args.concurrency:
            pd_ttft, pd_tpot = asyncio.run(level(pd.url, c, args.requests_per_level, args.prompt_len, args.new))
            co_ttft, co_tpot = asyncio.run(level(co.url, c, args.requests_per_level, args.prompt_len, args.new))
            rows.append((c, pd_ttft, co_ttft, pd_tpot, co_tpot))
            print(f"  concurrency {c}: done", flush=True)
        pd.stop()  # its engines' transfer agents would compete for the CPU
        served, local = overhead(co.url, args.prompt_len, args.new, args.overhead_repeats)
    finally:
        pd.stop()
        co.stop()

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"\nServing latency, embedded tiny model, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {when}"
    )
    print(
        f"prompt {args.prompt_len} tokens, {args.new} output tokens, greedy; medians over "
        f"{args.requests_per_level} x concurrency requests\n"
    )
    print("| concurrency | TTFT P/D (ms) | TTFT colocated (ms) | ratio | TPOT P/D (ms) | TPOT colocated (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c, pt, ct, pp, cp in rows:
        print(
            f"| {c} | {pt * 1e3:.1f} | {ct * 1e3:.1f} | {pt / ct:.2f} | {pp * 1e3:.2f} | {cp * 1e3:.2f} | {pp / cp:.2f} |"
        )
    print(f"\nGateway + router + worker hop, one request of {args.new} tokens at a time (colocated):")
    print("| through the cluster (ms) | engine in-process (ms) | overhead per request (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    print(f"| {served * 1e3:.1f} | {local * 1e3:.1f} | {(served - local) * 1e3:.1f} | {served / local:.2f} |")


if __name__ == "__main__":
    main()
