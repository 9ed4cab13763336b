"""The controller on a multi-node Ray cluster whose nodes stand in for the chart's worker groups:
each engine lands on a node of its own group, a pool resized under streaming load loses no request,
and a pool whose resource no node offers is reported by `/health` and `deepinfer status` until its
start gives up, never a silent hang."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from services.common.errors import ServiceError
from services.common.workers import POOL_DECODE, POOL_PREFILL
from services.controller.placement import PoolPlacement, default_resource

pytestmark = pytest.mark.slow


async def _stream(url: str, prompt: str, max_tokens: int) -> tuple[int, list, list]:
    """One streaming completion: (output tokens, as its usage counts them; finish reasons; errors)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    tokens, reasons, errors = 0, [], []
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                        continue
                    if chunk.get("usage"):  # a chunk may carry several tokens: count them from usage
                        tokens = chunk["usage"]["completion_tokens"]
                    reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
    except Exception as e:  # a lost stream is what the test looks for
        errors.append(repr(e))
    return tokens, reasons, errors


def _health(groups) -> httpx.Response:
    return httpx.get(f"{groups.head.http_url}/health", timeout=10)


def test_every_engine_lands_on_a_node_of_its_own_group(groups):
    groups.run(groups.controller.scale({POOL_PREFILL: 1, POOL_DECODE: 1}))
    assert groups.ready_sizes() == {POOL_PREFILL: 1, POOL_DECODE: 1}
    for worker_id, actor in groups.controller.actors.items():
        assert groups.node_of(worker_id) == groups.nodes[actor.pool].node_id, worker_id
    assert _health(groups).status_code == 200


def test_a_pool_resized_under_streaming_load_loses_no_request(groups):
    groups.run(groups.controller.scale({POOL_PREFILL: 1, POOL_DECODE: 1}))
    url = groups.head.http_url
    first = [groups.submit(_stream(url, f"scale me {i}", 48)) for i in range(4)]
    groups.run(groups.controller.scale({POOL_DECODE: 2}))
    assert groups.ready_sizes()[POOL_DECODE] == 2
    decode_nodes = {groups.node_of(w) for w, a in groups.controller.actors.items() if a.pool == POOL_DECODE}
    assert decode_nodes == {groups.nodes[POOL_DECODE].node_id}
    more = [groups.submit(_stream(url, f"spread me {i}", 48)) for i in range(4)]
    deadline = time.monotonic() + 60
    while min(h.inflight for h in groups.head.router.registry.pool(POOL_DECODE)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the newest engine (the one drained next) holds streams when the pool shrinks
    groups.run(groups.controller.scale({POOL_DECODE: 1}))
    assert groups.ready_sizes()[POOL_DECODE] == 1
    for future in first + more:
        tokens, reasons, errors = future.result(300)
        assert errors == [] and reasons == ["length"] and tokens == 48


def test_a_pool_no_node_can_take_is_reported_then_given_up(groups):
    controller = groups.controller
    groups.run(controller.scale({POOL_PREFILL: 0}))
    good = controller.spec.placements[POOL_PREFILL]
    controller.spec.placements[POOL_PREFILL] = PoolPlacement("deepinfer_nowhere")
    controller.spec.start_timeout_s = 8.0
    try:
        pending = groups.submit(controller.scale({POOL_PREFILL: 1}))
        deadline = time.monotonic() + 30
        while "deepinfer_nowhere" not in _health(groups).json()["detail"] and time.monotonic() < deadline:
            time.sleep(0.2)
        health = _health(groups)
        assert health.status_code == 503
        assert "prefill pool: an engine has waited" in health.json()["detail"]
        assert "no node offers Ray resource 'deepinfer_nowhere'" in health.json()["detail"]
        status = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "status", "--address", groups.head.grpc_address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0 and "deepinfer_nowhere" in status.stdout, status.stdout + status.stderr
        with pytest.raises(ServiceError, match="never placed"):
            pending.result(60)
        assert "deepinfer_nowhere" not in _health(groups).json()["detail"]
    finally:
        controller.spec.placements[POOL_PREFILL] = good
        controller.spec.start_timeout_s = 900.0
    groups.run(controller.scale({POOL_PREFILL: 1}))
    assert _health(groups).status_code == 200
    assert default_resource(POOL_PREFILL) == good.resource


def test_a_killed_engine_leaves_routing_and_is_replaced_at_once(groups):
    """No poll, no planner: the controller's death watch removes it and starts a new one."""
    import os
    import signal

    from services.metrics.definitions import WORKER_RESTARTS

    groups.run(groups.controller.scale({POOL_PREFILL: 1, POOL_DECODE: 1}))
    victim = groups.head.router.registry.pool(POOL_DECODE)[0]
    restarts = WORKER_RESTARTS.labels("decode")._value.get()
    killed = time.monotonic()
    os.kill(victim.info.pid, signal.SIGKILL)
    while victim.worker_id in groups.head.router.registry.workers and time.monotonic() < killed + 10:
        time.sleep(0.05)
    left_after = time.monotonic() - killed
    deadline = time.monotonic() + 120
    while not groups.head.router.registry.pool(POOL_DECODE) and time.monotonic() < deadline:
        time.sleep(0.1)
    ready = groups.head.router.registry.pool(POOL_DECODE)
    assert left_after < 5, left_after
    assert len(ready) == 1 and ready[0].worker_id != victim.worker_id
    assert WORKER_RESTARTS.labels("decode")._value.get() == restarts + 1
    assert not groups.controller.needs_repair()


def test_an_engine_the_router_dropped_is_replaced_by_reconcile(groups):
    """Alive but dropped (it stopped answering the polls): the planner's reconcile replaces it."""
    groups.run(groups.controller.scale({POOL_PREFILL: 1, POOL_DECODE: 1}))
    victim = groups.head.router.registry.pool(POOL_DECODE)[0]
    groups.run(groups.head.router.registry.remove(victim.worker_id))
    assert groups.controller.needs_repair()
    groups.run(groups.controller.reconcile())
    ready = groups.head.router.registry.pool(POOL_DECODE)
    assert len(ready) == 1 and ready[0].worker_id != victim.worker_id
    assert not groups.controller.needs_repair()
    assert asyncio.iscoroutinefunction(groups.controller.reconcile)
