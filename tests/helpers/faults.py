"""Fault tests' shared parts against a `deepinfer serve` process: streams that record what the client
got, the cluster's view of every stage, killing engines, and the check that every stage is back at
rest (no request, reservation, in-flight count or KV block still held)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Optional

import grpc
import httpx

from deepinfer_proto import common_pb2, gateway_pb2_grpc
from tests.helpers.cluster import wait_until

PREFILL, DECODE = 2, 3


def status(serve) -> common_pb2.ClusterStatus:
    with grpc.insecure_channel(serve.grpc_address) as ch:
        return gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)


def workers(serve, pool: int) -> list[common_pb2.WorkerStatus]:
    return [w for p in status(serve).pools if p.pool == pool for w in p.workers]


def kill(worker: common_pb2.WorkerStatus) -> None:
    os.kill(worker.info.pid, signal.SIGKILL)


def held(serve) -> dict[str, tuple]:
    """What each stage still holds: worker id -> (router in flight, engine requests, reservations,
    KV blocks in use, open streams), from each worker's freshest report."""
    out = {}
    for p in status(serve).pools:
        for w in p.workers:
            used = w.load.num_blocks - w.load.free_blocks
            out[w.info.worker_id] = (w.inflight, w.load.requests, w.load.reservations, used, w.load.open_streams)
    return out


def wait_at_rest(serve, timeout_s: float = 60.0, prefix_blocks: Optional[dict[str, int]] = None) -> dict[str, tuple]:
    """Until nothing is held anywhere (blocks the prefix cache keeps for reuse aside: `prefix_blocks`,
    worker id -> blocks in use at rest); returns the last view."""
    prefix_blocks = prefix_blocks or {}

    def rest():
        view = held(serve)
        ok = all(v[:3] == (0, 0, 0) and v[4] == 0 and v[3] <= prefix_blocks.get(w, 0) for w, v in view.items())
        return view if ok else None

    return wait_until(rest, timeout_s, 0.25) or held(serve)


def long_prompt(i: int) -> str:
    """~470 tokens, none shared with another request's (no prefix cache hit shortens its prefill)."""
    return f"request {i}: " + " ".join(f"chapter {j} of story {i}" for j in range(36))


def wait_fence_lifted(serve, killed_at: float, timeout_s: float = 15.0) -> tuple[float, int]:
    """Until no CE holds a fenced reservation (at least a second after `killed_at`, a
    `time.monotonic()`: past the first polls after a kill): (seconds after the kill, most fenced
    reservations seen meanwhile); the seconds are `timeout_s` or more when the fence stayed."""
    seen = 0

    def lifted() -> bool:
        nonlocal seen
        fenced = sum(w.load.fenced_reservations for w in workers(serve, DECODE))
        seen = max(seen, fenced)
        return fenced == 0 and time.monotonic() - killed_at > 1.0

    wait_until(lifted, timeout_s=timeout_s, interval_s=0.1)
    return time.monotonic() - killed_at, seen


class Streams:
    """Streaming completions in threads; each records its text, finish reasons and errors."""

    def __init__(self, serve, prompts: list[str], max_tokens: int, **extra):
        self.texts = [""] * len(prompts)
        self.chunks = [0] * len(prompts)
        self.results: list = [None] * len(prompts)
        self.threads = []
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}
            self.threads.append(threading.Thread(target=self._run, args=(serve, i, body), daemon=True))
        for t in self.threads:
            t.start()

    def _run(self, serve, i: int, body: dict) -> None:
        reasons, errors = [], []
        try:
            with httpx.stream("POST", f"{serve.base_url}/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                        continue
                    self.texts[i] += chunk["choices"][0]["text"]
                    self.chunks[i] += 1
                    reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        except Exception as e:
            errors.append(repr(e))
        self.results[i] = (reasons, errors)

    def join(self, timeout_s: float = 300.0) -> list:
        for t in self.threads:
            t.join(timeout_s)
        return self.results


def complete(serve, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{serve.base_url}/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]
