"""The token path from streaming workers to the router over real gRPC on 127.0.0.1: one
subscription per worker carries every request's deltas, one message per engine turn. Real
engines on the embedded model (a PE and a CE with real NIXL agents, and a NORMAL engine) in
worker servers of this process.

What the client gets through the subscriptions equals what it gets through each request's own
stream (the reference path), token for token and character for character; cancelling mid-stream
frees everything on the workers and in the router; a subscription that ends fails its requests
with UNAVAILABLE and the next request opens a new one; a lagging reader gets merged deltas."""

import asyncio
import contextlib
import time
from typing import Optional

import grpc
import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core import SamplingParams  # noqa: E402
from deepinfer_proto import worker_pb2, worker_pb2_grpc  # noqa: E402
from services.common.errors import ErrorCode, ServiceError  # noqa: E402
from services.common.grpc_util import channel  # noqa: E402
from services.common.params import params_to_proto  # noqa: E402
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL  # noqa: E402
from services.metrics import definitions as m  # noqa: E402
from services.router.clients import GrpcWorkerClient  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.router.core import RouterCore  # noqa: E402
from services.router.registry import PoolRegistry  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import WorkerServer  # noqa: E402

ARGS = EngineSettings(device="cpu", num_gpu_blocks=96, max_model_len=128, block_size=8)
PD = (POOL_PREFILL, POOL_DECODE)
COLOCATED = (POOL_COLOCATED,)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42, 17, 3], [100, 200, 300, 400, 500], [9, 9, 9, 9]]
WAIT_S = 60.0
"""The bound on every test's wait."""


@pytest.fixture(scope="module")
def workers():
    specs = [("pe-0", POOL_PREFILL), ("ce-0", POOL_DECODE), ("normal-0", POOL_COLOCATED)]
    servers = {name: WorkerServer(WorkerSpec(name, pool, ARGS, metrics=False)) for name, pool in specs}
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@contextlib.asynccontextmanager
async def _router(workers, pools, batched: bool = True, **config):
    registry = PoolRegistry(lambda info: GrpcWorkerClient(info, batched=batched))
    for server in workers.values():
        if server.info.pool in pools:
            await registry.add(server.info)
    router = RouterCore(registry, RouterConfig(pools=pools, **config))
    try:
        yield router
    finally:
        await router.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def _client_view(router: RouterCore, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    """Per sample: tokens, text, logprobs, finish and stop reason, as the client sees them."""
    samples: dict[int, dict] = {}
    async for d in router.generate(request_id, prompt, params):
        s = samples.setdefault(d.index, {"tokens": [], "text": "", "logprobs": [], "finish": None, "stop": None})
        assert d.token_offset == len(s["tokens"]) and d.text_offset == len(s["text"])  # append-only for the client
        s["tokens"] += d.token_ids
        s["text"] += d.text
        s["logprobs"] += [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in d.logprobs or []]
        s["finish"], s["stop"] = d.finish_reason or s["finish"], d.stop_reason or s["stop"]
    return [samples[i] for i in sorted(samples)]


async def _all_at_once(router: RouterCore, cases: list[tuple[list[int], SamplingParams]]) -> list:
    return await asyncio.gather(*(_client_view(router, f"case-{i}", p, sp) for i, (p, sp) in enumerate(cases)))


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _stop_inside(text: str) -> str:
    """Two characters first seen in the middle of `text`: a stop string that ends it there."""
    for start in range(len(text) // 3, len(text) - 2):
        stop = text[start : start + 2]
        if stop.strip() and text.find(stop) == start:
            return stop
    raise AssertionError(f"no stop string to cut {text!r} with")


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g, w, strict=True):
            assert (gs["tokens"], gs["text"], gs["finish"], gs["stop"]) == (
                ws["tokens"],
                ws["text"],
                ws["finish"],
                ws["stop"],
            )
            assert [lp[0] for lp in gs["logprobs"]] == [lp[0] for lp in ws["logprobs"]]
            assert [lp[1] for lp in gs["logprobs"]] == pytest.approx([lp[1] for lp in ws["logprobs"]], abs=1e-4)


@pytest.mark.parametrize("pools", [PD, COLOCATED], ids=["disaggregated", "colocated"])
def test_batched_streams_equal_the_per_request_streams(workers, pools):
    async def run():
        async with _router(workers, pools, batched=False) as legacy:
            plain = await _client_view(legacy, "probe", PROMPTS[0], _greedy(16))
            stop = _stop_inside(plain[0]["text"])
            cases = [
                (PROMPTS[0], _greedy(16)),
                (PROMPTS[0], _greedy(16, stop=[stop])),  # cut mid-stream, in a batch with the others
                (PROMPTS[1], SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)),
                (PROMPTS[2], SamplingParams(temperature=0.7, seed=3, max_tokens=9, ignore_eos=True, logprobs=2)),
                (PROMPTS[3], _greedy(1)),
                (PROMPTS[1], _greedy(12, stop=[stop, "\n"], min_tokens=2)),
            ]
            want = await _all_at_once(legacy, cases)
        async with _router(workers, pools, batched=True) as batched:
            got = await _all_at_once(batched, cases)
            clients = [h.client for h in batched.registry.workers.values()]
            subscribed = [c._subscription is not None for c in clients if c.worker_id != "pe-0"]
        return stop, want, got, subscribed

    stop, want, got, subscribed = _run(run())
    assert subscribed == [True]
    _same(got, want)
    assert want[1][0]["finish"] == "stop" and want[1][0]["stop"] == stop and stop not in want[1][0]["text"]
    assert len(want[2]) == 3 and len({tuple(s["tokens"]) for s in want[2]}) > 1  # n=3, each its own seed
    assert len(want[3][0]["logprobs"]) == 9 and all(len(top) >= 2 for _, _, top in want[3][0]["logprobs"])


async def _settled(router: Optional[RouterCore], workers, names: list[str]) -> dict:
    """Waits until the router (if any) holds nothing and the workers hold no request and every
    KV block is free; returns what was last seen."""
    deadline = time.monotonic() + 20
    handles = list(router.registry.workers.values()) if router is not None else []
    while True:
        seen = {
            "inflight": [(h.inflight, h.inflight_tokens) for h in handles],
            "inboxes": sum(len(getattr(h.client, "_inboxes", {})) for h in handles),
            "loads": [workers[n].core.stats() for n in names],
            "tracked": [len(workers[n].core.streams) for n in names if hasattr(workers[n].core, "streams")],
        }
        idle = all(x == (0, 0) for x in seen["inflight"]) and not seen["inboxes"] and not any(seen["tracked"])
        if idle and all(ld.requests == 0 and ld.free_blocks == ld.num_blocks for ld in seen["loads"]):
            return seen
        if time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.05)


async def _leave_after(router: RouterCore, request_id: str, tokens: int) -> int:
    stream = router.generate(request_id, PROMPTS[0], _greedy(100))
    got = 0
    try:
        async for d in stream:
            got += len(d.token_ids)
            if got >= tokens:
                break
    finally:
        await stream.aclose()
    return got


@pytest.mark.parametrize("pools", [PD, COLOCATED], ids=["disaggregated", "colocated"])
def test_cancelling_mid_stream_frees_the_engines_and_the_router(workers, pools):
    names = ["pe-0", "ce-0"] if pools == PD else ["normal-0"]

    async def run():
        async with _router(workers, pools) as router:
            left = await asyncio.gather(
                _leave_after(router, "leave-1", 1),
                _leave_after(router, "leave-2", 3),
                _client_view(router, "stay", PROMPTS[1], _greedy(8)),
                _leave_after(router, "leave-3", 2),
            )
            return left, await _settled(router, workers, names)

    left, seen = _run(run())
    assert left[2][0]["finish"] == "length" and len(left[2][0]["tokens"]) == 8
    assert all(x == (0, 0) for x in seen["inflight"]) and seen["inboxes"] == 0 and not any(seen["tracked"])
    assert [(ld.requests, ld.reservations, ld.free_blocks) for ld in seen["loads"]] == [
        (0, 0, ld.num_blocks) for ld in seen["loads"]
    ]


def _end_subscriptions(server: WorkerServer) -> int:
    """End every subscription on the worker, as a worker going away would (on its own loop)."""

    async def end() -> int:
        outboxes = list(server.core.subscribers.values())
        for outbox in outboxes:
            server.core.close_subscription(outbox)
        return len(outboxes)

    return asyncio.run_coroutine_threadsafe(end(), server.loop).result(10)


def test_a_subscription_that_ends_fails_its_requests_and_the_next_request_opens_another(workers):
    """Without migration (`migration_limit=0`): the broken stream's request fails."""
    server = workers["normal-0"]

    async def run():
        async with _router(workers, COLOCATED, migration_limit=0) as router:
            client = router.registry.workers["normal-0"].client
            stream = router.generate("cut-off", PROMPTS[0], _greedy(100))
            await anext(stream)
            first_id = client._subscription.subscriber_id
            ended = await asyncio.to_thread(_end_subscriptions, server)
            with pytest.raises(ServiceError) as e:
                async for _ in stream:
                    pass
            again = await _client_view(router, "after", PROMPTS[1], _greedy(5))
            return (
                ended,
                e.value,
                first_id,
                client._subscription.subscriber_id,
                again,
                await _settled(router, workers, ["normal-0"]),
            )

    ended, error, first_id, second_id, again, seen = _run(run())
    assert ended == 1 and error.code is ErrorCode.UNAVAILABLE and "normal-0" in error.message
    assert second_id != first_id and again[0]["finish"] == "length" and len(again[0]["tokens"]) == 5
    assert seen["loads"][0].requests == 0 and seen["loads"][0].free_blocks == seen["loads"][0].num_blocks


def test_a_subscription_that_ends_mid_stream_migrates_its_request_token_identically(workers):
    """With migration (the default) the request goes on, over a new subscription, from prompt +
    tokens so far: the client's tokens and text are the undisturbed run's."""
    server = workers["normal-0"]

    async def run():
        async with _router(workers, COLOCATED) as router:
            undisturbed = await _client_view(router, "calm", PROMPTS[0], _greedy(60))
            stream = router.generate("cut-off", PROMPTS[0], _greedy(60))
            tokens, text = [], ""
            for _ in range(3):
                delta = await anext(stream)
                tokens, text = tokens + delta.token_ids, text + delta.text
            await asyncio.to_thread(_end_subscriptions, server)
            async for delta in stream:
                assert delta.token_offset == len(tokens) and delta.text_offset == len(text)
                tokens, text = tokens + delta.token_ids, text + delta.text
            return undisturbed, tokens, text, await _settled(router, workers, ["normal-0"])

    before = m.MIGRATIONS.labels("unavailable")._value.get()
    undisturbed, tokens, text, seen = _run(run())
    assert tokens == undisturbed[0]["tokens"] and text == undisturbed[0]["text"] and len(tokens) == 60
    assert m.MIGRATIONS.labels("unavailable")._value.get() == before + 1
    assert seen["loads"][0].requests == 0 and seen["loads"][0].free_blocks == seen["loads"][0].num_blocks


def test_a_lagging_reader_gets_merged_deltas_and_a_deadline_ends_a_request(workers):
    info = workers["normal-0"].info

    async def run():
        client = GrpcWorkerClient(info)
        try:
            stream = client.generate("lag", PROMPTS[2], _greedy(40), 30)
            deltas = [await anext(stream)]
            await asyncio.sleep(0.5)  # the engine runs on; the deltas queue up in the inbox
            deltas += [d async for d in stream]
            with pytest.raises(ServiceError) as e:
                async for _ in client.generate("late", PROMPTS[0], _greedy(100), 0.3):
                    pass
            await client.abort("late", prefill=False)
            reference = GrpcWorkerClient(info, batched=False)
            want = [d async for d in reference.generate("ref", PROMPTS[2], _greedy(40), 30)]
            await reference.close()
            return deltas, e.value, want
        finally:
            await client.close()

    deltas, error, want = _run(run())
    assert [t for d in deltas for t in d.token_ids] == [t for d in want for t in d.token_ids]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in want) and deltas[-1].finish_reason == "length"
    assert len(deltas) < len(want) == 40
    assert error.code is ErrorCode.DEADLINE_EXCEEDED and "normal-0" in error.message


def test_a_subscriber_that_goes_away_aborts_its_requests_on_the_worker(workers):
    server = workers["normal-0"]

    def work(request_id: str, subscriber_id: str) -> worker_pb2.GenerateWork:
        params = params_to_proto(_greedy(100))
        return worker_pb2.GenerateWork(
            request_id=request_id, prompt_token_ids=PROMPTS[0], params=params, subscriber_id=subscriber_id
        )

    async def run():
        async with channel(server.info.address) as ch:
            stub = worker_pb2_grpc.DecodeStub(ch)
            call = stub.Subscribe(worker_pb2.SubscribeRequest(subscriber_id="gone-soon"))
            await call.initial_metadata()
            twin = stub.Subscribe(worker_pb2.SubscribeRequest(subscriber_id="gone-soon"))
            refused = [(await twin.code(), await twin.details())]
            for rid in ("orphan-1", "orphan-2"):
                await stub.Submit(work(rid, "gone-soon"), timeout=10)
            seen: set[str] = set()
            while seen != {"orphan-1", "orphan-2"}:
                seen |= {item.request_id for item in (await call.read()).items}
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Submit(work("stray", "nobody"), timeout=10)
            refused.append((e.value.code(), e.value.details()))
            call.cancel()  # the router went away
            return refused, await _settled(None, workers, ["normal-0"])

    refused, seen = _run(run())
    assert refused[0][0] == grpc.StatusCode.FAILED_PRECONDITION and "already subscribed" in refused[0][1]
    assert refused[1][0] == grpc.StatusCode.UNAVAILABLE and "no subscription 'nobody'" in refused[1][1]
    load = seen["loads"][0]
    assert load.requests == 0 and load.free_blocks == load.num_blocks and seen["tracked"] == [0]
