"""Vision encoders as their own pool: what batching, the E -> P -> D path and the NIXL READ cost.

    python benchmarks/encoder_pool.py [--skip-serve] [--json out.json]

1. images/s through a VE core (the real batcher, cache off, NIXL pool): 64 requests of one image
   at once with batches of up to 16, vs one at a time (batches of 1, sequential requests);
2. TTFT of a one-image chat through `deepinfer serve` (embedded model): E -> P -> D (embeddings
   over NIXL), P/D with the PE encoding in process (`--encoder 0`), and one NORMAL engine
   encoding in process (`--colocated`); sequential requests, distinct images;
3. the embeddings READ (VE pool -> PE receive buffer, UCX on this host) against a `copy_` of the
   same bytes, at LLaVA-1.5-7B's embedding size (576 tokens x 4096, fp16: 4.5 MiB per image).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from PIL import Image  # noqa: E402


def _png(seed: int, size: int = 64) -> bytes:
    rng = random.Random(seed)
    buf = io.BytesIO()
    Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(buf, format="PNG")
    return buf.getvalue()


# ---- 1. batching ---------------------------------------------------------------------------
def bench_batching(n: int = 64) -> dict:
    from deepinfer_core.engine_args import EngineArgs
    from deepinfer_core.multimodal.encoder_config import EncoderConfig
    from deepinfer_core.multimodal.encoder_runner import VisionEncoderRunner
    from services.workers.encoder_core import EncoderCore

    model_config = EngineArgs().create_model_config("cpu")
    images = [_png(i) for i in range(2 * n)]

    async def run(batch: int, concurrent: bool, offset: int) -> float:
        config = EncoderConfig(max_batch_images=batch, max_wait_s=0.002, cache_bytes=0)
        core = EncoderCore(VisionEncoderRunner.from_model_config(model_config, "cpu", config), "bench")
        core.start()
        try:
            await core.encode("warm", [images[-1]])
            start = time.perf_counter()
            if concurrent:
                results = await asyncio.gather(*(core.encode(f"r{i}", [images[offset + i]]) for i in range(n)))
            else:
                results = [await core.encode(f"r{i}", [images[offset + i]]) for i in range(n)]
            seconds = time.perf_counter() - start
            core.release([h.lease_id for hs in results for h in hs])
            return n / seconds
        finally:
            core.stop()

    return {
        "batched_16_images_per_s": asyncio.run(run(16, True, 0)),
        "one_at_a_time_images_per_s": asyncio.run(run(1, False, n)),
        "images": n,
    }


# ---- 2. TTFT through serve ---------------------------------------------------------------
_READY = re.compile(r"OpenAI API at (http://\S+)/v1 ")


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "services.cli.main", "serve", "--port", "0", "--grpc-port", "0",
           "--num-blocks", "256", "--block-size", "16", "--max-model-len", "512", *args]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        match = _READY.search(line)
        if match:  # keep reading its output, or a full pipe would stall it
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, match.group(1)
        if time.monotonic() > deadline:
            break
    _stop(proc)
    raise RuntimeError(f"serve {' '.join(args)} did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _ttft(url: str, n: int, seed: int) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=120) as client:
        for i in range(n + 2):  # the first two warm the path
            image = "data:image/png;base64," + base64.b64encode(_png(seed + i)).decode()
            content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": image}}]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
            start = time.perf_counter()
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {") and '"content"' in line:
                        out.append(time.perf_counter() - start)
                        break
                for _ in lines:
                    pass
    return out[2:]


def bench_ttft(n: int = 20) -> dict:
    results = {}
    for name, args in (("epd_nixl", ()), ("pd_pe_encodes", ("--encoder", "0")), ("normal", ("--colocated",))):
        proc, url = _serve(*args)
        try:
            times = _ttft(url, n, seed=1000 * len(results))
        finally:
            _stop(proc)
        results[name] = {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * sorted(times)[int(0.9 * n)]}
    return results


# ---- 3. READ vs memcpy -------------------------------------------------------------------
def bench_transfer(shape=(576, 4096), dtype=torch.float16, reps: int = 20) -> dict:
    from deepinfer_core.multimodal.embedding_pool import EmbeddingPool
    from deepinfer_core.multimodal.embedding_reader import EmbeddingReader

    out = {}
    for per_read in (1, 8):
        pool = EmbeddingPool(shape, dtype, per_read * shape[0] * shape[1] * 2, lease_s=60)
        reader = EmbeddingReader(num_slots=per_read)
        embeds = torch.randn(*shape).to(dtype)
        num_bytes = per_read * pool.slot_bytes
        seconds = []
        for _ in range(reps + 2):
            handles = [pool.park(embeds, 1) for _ in range(per_read)]
            start = time.perf_counter()
            reader.read(handles)
            seconds.append(time.perf_counter() - start)
            for h in handles:
                pool.release(h.lease_id)
        src, dst = torch.empty(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
        copies = []
        for _ in range(reps + 2):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
        out[f"{per_read}_images"] = {
            "bytes": num_bytes,
            "nixl_read_gb_s": num_bytes / statistics.median(seconds[2:]) / 1e9,
            "nixl_read_ms": 1e3 * statistics.median(seconds[2:]),
            "memcpy_gb_s": num_bytes / statistics.median(copies[2:]) / 1e9,
        }
        reader.close()
        pool.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-serve", action="store_true", help="leave out the TTFT part (it starts three clusters)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {"batching": bench_batching(), "transfer": bench_transfer()}
    if not args.skip_serve:
        results["ttft"] = bench_ttft()
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
