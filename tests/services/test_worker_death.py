"""A streaming worker killed mid-stream: its subscription breaks and every one of its requests
ends with UNAVAILABLE naming the worker, at once (no hang until a deadline), and the router
holds nothing for it afterwards. The worker is a real process on 127.0.0.1, killed with SIGKILL."""

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from deepinfer_core import SamplingParams
from deepinfer_core.roles import EngineType
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_COLOCATED, WorkerInfo
from services.router.clients import GrpcWorkerClient
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry

ROOT = Path(__file__).resolve().parents[2]
_SERVE = """
import sys, time
from services.common.workers import POOL_COLOCATED
from services.workers.spec import EngineSettings, WorkerSpec
from services.workers.worker_server import WorkerServer, build_engine

spec = WorkerSpec("doomed-0", POOL_COLOCATED, EngineSettings(device="cpu", num_gpu_blocks=256, max_model_len=512, block_size=16), metrics=False)
engine = build_engine(spec)
step = engine.step
engine.step = lambda: time.sleep(0.01) or step()  # paced: the streams are still running when it dies
server = WorkerServer(spec, engine)
print("ADDRESS", server.start().address, flush=True)
sys.stdin.read()
"""
"""A NORMAL worker on the embedded model whose steps take at least 10 ms; prints its address."""


def _start_worker() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            proc.kill()
            raise AssertionError("the worker process did not start") from None
        if line.startswith("ADDRESS "):
            return proc, line.split()[1]


async def _stream_until_killed(router: RouterCore, request_id: str, started: asyncio.Event) -> tuple[int, object]:
    tokens = 0
    try:
        async for delta in router.generate(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=480, ignore_eos=True)):
            tokens += len(delta.token_ids)
            if tokens >= 2:
                started.set()
    except ServiceError as e:
        return tokens, e
    return tokens, None


def test_a_worker_killed_mid_stream_ends_its_requests_with_unavailable():
    proc, address = _start_worker()
    info = WorkerInfo("doomed-0", POOL_COLOCATED, EngineType.NORMAL.value, address, max_model_len=512)
    info.block_size, info.num_blocks, info.max_num_seqs = 16, 256, 64  # room for all three at once

    async def run():
        registry = PoolRegistry(GrpcWorkerClient)
        await registry.add(info)
        # no migration: with no other worker to move to, the requests end with the error
        router = RouterCore(registry, RouterConfig(pools=(POOL_COLOCATED,), migration_limit=0))
        started = [asyncio.Event() for _ in range(3)]
        try:
            streams = [
                asyncio.ensure_future(_stream_until_killed(router, f"doomed-{i}", ev)) for i, ev in enumerate(started)
            ]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
            os.kill(proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 20)  # no hang
            handle = registry.workers["doomed-0"]
            return results, (handle.inflight, handle.inflight_tokens, len(handle.client._inboxes))
        finally:
            await router.stop()

    try:
        results, held = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        proc.kill()
        proc.wait(10)
    for tokens, error in results:
        assert 2 <= tokens < 480 and isinstance(error, ServiceError), (tokens, error)
        assert error.code is ErrorCode.UNAVAILABLE and "doomed-0" in error.message and "unreachable" in error.message
    assert held == (0, 0, 0)
