"""A vision encoder's leases against real processes: an encoder worker process parks embeddings for a
consumer process that is SIGKILLed before it reads them (a PE, or the router that would release them,
dying): the encoder lets the slots go when the leases end, by itself, and serves on.

Then the router's side, a real `RouterCore` over gRPC to that encoder and a prefill stand-in that
READs the embeddings over NIXL as a PE does (the CE stand-in only makes the request wait): a request
that waits for a CE far longer than its lease still reads its embeddings (the router renews the
lease while it waits), and one cancelled while it waits has its leases released at once."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import grpc
import pytest

pytest.importorskip("nixl")

import asyncio  # noqa: E402

from deepinfer_core import SamplingParams  # noqa: E402
from deepinfer_core.config import PDConfig  # noqa: E402
from deepinfer_core.transfer.messages import KVTarget  # noqa: E402
from deepinfer_proto import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from services.common.deltas import SampleDelta  # noqa: E402
from services.common.errors import ErrorCode, ServiceError  # noqa: E402
from services.common.prefill_result import PrefillResult  # noqa: E402
from services.common.workers import POOL_DECODE, POOL_ENCODER, POOL_PREFILL, WorkerInfo, WorkerLoad  # noqa: E402
from services.router.clients import GrpcWorkerClient  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.router.core import RouterCore  # noqa: E402
from services.router.registry import PoolRegistry  # noqa: E402
from services.workers.embedding_fetcher import EmbeddingFetcher  # noqa: E402
from tests.helpers.images import make_png  # noqa: E402

LEASE_S = 1.0
_CONTEXT = multiprocessing.get_context("spawn")


def _encoder(addresses) -> None:
    from deepinfer_core.multimodal.encoder_config import EncoderConfig
    from services.common.workers import POOL_ENCODER
    from services.workers.spec import WorkerSpec
    from services.workers.worker_server import WorkerServer

    config = EncoderConfig(lease_s=LEASE_S, max_wait_s=0.01)
    server = WorkerServer(WorkerSpec("ve-proc", POOL_ENCODER, encoder=config, metrics=False))
    addresses.put(server.start().address)
    while True:
        time.sleep(60)


def _consumer(address: str, parked) -> None:
    """Asks for two images' embeddings, says so, and never reads nor releases them."""
    with grpc.insecure_channel(address) as ch:
        pngs = [make_png(40, 36, seed=s) for s in (7, 8)]
        reply = worker_pb2_grpc.EncoderStub(ch).Encode(
            worker_pb2.EncodeRequest(request_id="doomed", images=pngs), timeout=60
        )
        parked.put([h.lease_id for h in reply.handles])
        time.sleep(600)


def _leases(stub) -> int:
    return stub.Stats(common_pb2.StatusRequest(), timeout=10).embedding_leases


@pytest.fixture(scope="module")
def encoder():
    addresses = _CONTEXT.Queue()
    proc = _CONTEXT.Process(target=_encoder, args=(addresses,), daemon=True)
    proc.start()
    try:
        yield addresses.get(timeout=120)
    finally:
        proc.kill()
        proc.join(10)


def test_embeddings_parked_for_a_consumer_that_dies_unread_are_freed_when_their_leases_end(encoder):
    parked = _CONTEXT.Queue()
    consumer = _CONTEXT.Process(target=_consumer, args=(encoder, parked), daemon=True)
    consumer.start()
    lease_ids = parked.get(timeout=120)
    os.kill(consumer.pid, signal.SIGKILL)  # dies holding two leases it never read
    consumer.join(10)
    with grpc.insecure_channel(encoder) as ch:
        worker, encoder_stub = worker_pb2_grpc.WorkerStub(ch), worker_pb2_grpc.EncoderStub(ch)
        assert len(lease_ids) == 2 and _leases(worker) == 2
        killed = time.monotonic()
        while _leases(worker) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        freed_after = time.monotonic() - killed
        assert _leases(worker) == 0, "the dead consumer's leases were never freed"
        assert freed_after < LEASE_S + 2.0 + 2.0  # the lease, its reuse grace, polling slack
        # the encoder serves on; a consumer that gives its lease back frees it at once
        reply = encoder_stub.Encode(
            worker_pb2.EncodeRequest(request_id="next", images=[make_png(30, 30, seed=9)]), timeout=60
        )
        assert _leases(worker) == 1
        release = worker_pb2.ReleaseRequest(lease_ids=[h.lease_id for h in reply.handles])
        assert encoder_stub.Release(release, timeout=10).released == 1 and _leases(worker) == 0


class Stages:
    """The CE and PE of the request: the CE's reservation answers after `reserve_delay_s`, the PE
    reads the embeddings over NIXL from the encoder process, as a real PE does; `stuck`: the stage
    ("reserve" or "prefill") where the request waits for good instead (`waiting` set once there),
    or "dead": the PE fails every prefill as a dead one does."""

    def __init__(self, reserve_delay_s: float = 0.0, stuck: str = ""):
        self.reserve_delay_s, self.stuck = reserve_delay_s, stuck
        self.waiting = asyncio.Event()
        self.fetcher = EmbeddingFetcher("pe-stand-in")
        self.reads: list[str] = []
        """"ok" or the error of each prefill's READ."""

    async def _wait(self, stage: str, delay_s: float) -> None:
        if self.stuck == stage:
            self.waiting.set()
            delay_s = 3600
        await asyncio.sleep(delay_s)

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        await self._wait("reserve", self.reserve_delay_s)
        return KVTarget(request_id, "ce", b"", 0, 1, 0, "DRAM", [0], "f", len(prompt))

    async def prefill(
        self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0
    ) -> PrefillResult:
        if self.stuck == "dead":  # the PE's process is gone before its READ: the call fails
            self.waiting.set()
            raise ServiceError(ErrorCode.UNAVAILABLE, "prefill worker pe-0 is unreachable")
        await self._wait("prefill", 0.0)
        try:
            await self.fetcher.read(list(images))
        except Exception as e:
            self.reads.append(str(e))
            raise
        self.reads.append("ok")
        return PrefillResult(SampleDelta(token_ids=[5], text="x"))

    async def stream(self, request_id, timeout):
        yield SampleDelta(token_offset=1, token_ids=[6], text_offset=1, text="y", finish_reason="length")

    async def abort(self, request_id, prefill, unused=False) -> bool:
        return True

    async def renew_lease(self, request_id, prefill, lease_s, expires_at, timeout) -> float:
        return time.time() + lease_s

    async def stats(self, timeout) -> WorkerLoad:
        return WorkerLoad()

    async def close(self) -> None:
        self.fetcher.close()


async def _router(
    encoder_address: str, stages: Stages, lease_s: float, **config
) -> tuple[RouterCore, GrpcWorkerClient]:
    def client(info: WorkerInfo):
        return GrpcWorkerClient(info) if info.pool == POOL_ENCODER else stages

    registry = PoolRegistry(client)
    for pool, name, address in (
        (POOL_DECODE, "ce-0", "ce"),
        (POOL_PREFILL, "pe-0", "pe"),
        (POOL_ENCODER, "ve-0", encoder_address),
    ):
        info = WorkerInfo(name, pool, 0, address, max_model_len=256, block_size=8, num_blocks=64, max_num_seqs=8)
        await registry.add(info, connect_peers=False)
    pd = PDConfig(renewed_lease_s=lease_s)
    pools = (POOL_PREFILL, POOL_DECODE, POOL_ENCODER)
    router = RouterCore(registry, RouterConfig(pools=pools, pd=pd, reserve_timeout_s=30.0, **config), "m")
    return router, registry.workers["ve-0"].client


def test_a_request_that_waits_past_its_lease_for_a_ce_still_reads_its_embeddings(encoder):
    """The lease is 4 s; the request waits 8 s for its reservation (past the lease and the pool's
    2 s reuse grace): the router's heartbeats keep the embeddings, and the PE's READ finds them.
    (A reader refuses a handle within 1 s of its end, and a beat comes every third of the lease:
    the lease must stay well above 1.5 s plus a renewal's round trip; the default is 10 s.)"""

    async def run():
        stages = Stages(reserve_delay_s=8.0)
        router, ve = await _router(encoder, stages, lease_s=4.0)
        try:
            before = await ve.stats(10)
            image = make_png(44, 38, seed=21)
            stream = router.generate("waits", [1, 2, 3], SamplingParams(max_tokens=2), images=[image])
            tokens = [t async for d in stream for t in d.token_ids]
            after = await ve.stats(10)
            deadline = time.monotonic() + 5
            while (await ve.stats(10)).embedding_leases and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return tokens, stages.reads, before, after, (await ve.stats(10)).embedding_leases
        finally:
            await router.stop()

    tokens, reads, before, after, leases = asyncio.run(asyncio.wait_for(run(), 60))
    assert reads == ["ok"], reads  # the first READ: no lease ran out, nothing was encoded again
    assert tokens == [5, 6]
    assert after.encoder_images + after.encoder_cache_hits == before.encoder_images + before.encoder_cache_hits + 1
    assert after.embedding_lease_renewals - before.embedding_lease_renewals >= 4  # a beat every 4/3 s
    assert leases == 0  # the READ's notice freed it


@pytest.mark.parametrize("stage", ["reserve", "prefill"])
def test_a_request_cancelled_while_it_waits_releases_its_leases_at_once(encoder, stage):
    """A 30 s lease; the request is cancelled while it waits for its CE (or on its PE): its leases
    are gone within a second, not at the end of the lease."""

    async def run():
        stages = Stages(stuck=stage)
        router, ve = await _router(encoder, stages, lease_s=30.0)
        try:

            async def consume():
                image = make_png(36, 44, seed=22)
                stream = router.generate("leaves", [1, 2, 3], SamplingParams(max_tokens=2), images=[image])
                return [d async for d in stream]

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(stages.waiting.wait(), 30)
            held = (await ve.stats(10)).embedding_leases
            task.cancel()
            cancelled_at = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await task
            while (await ve.stats(10)).embedding_leases and time.monotonic() - cancelled_at < 10:
                await asyncio.sleep(0.02)
            return held, time.monotonic() - cancelled_at, (await ve.stats(10)).embedding_leases
        finally:
            await router.stop()

    held, freed_after, leases = asyncio.run(asyncio.wait_for(run(), 60))
    assert held == 1 and leases == 0
    assert freed_after < 1.0, freed_after


def test_the_leases_of_a_request_whose_pe_died_before_reading_are_released_at_once(encoder):
    """A 30 s lease; the only PE fails the prefill as a dead one does: the leases are gone within a
    second and the request fails with a clear error. One prefill attempt: a second would encode the
    image afresh, and hold that copy's lease while it waits for another PE, which makes "gone"
    a race between the first copy's release and the second's encode."""

    async def run():
        stages = Stages(stuck="dead")
        router, ve = await _router(encoder, stages, lease_s=30.0, failed_pool_grace_s=2.0, max_prefill_attempts=1)
        try:

            async def consume():
                image = make_png(40, 40, seed=23)
                stream = router.generate("orphaned", [1, 2, 3], SamplingParams(max_tokens=2), images=[image])
                return [d async for d in stream]

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(stages.waiting.wait(), 30)
            failed_at = time.monotonic()
            while (await ve.stats(10)).embedding_leases and time.monotonic() - failed_at < 10:
                await asyncio.sleep(0.02)
            freed_after = time.monotonic() - failed_at
            with pytest.raises(ServiceError) as error:
                await task
            return freed_after, (await ve.stats(10)).embedding_leases, error.value
        finally:
            await router.stop()

    freed_after, leases, error = asyncio.run(asyncio.wait_for(run(), 60))
    assert leases == 0 and freed_after < 1.0, freed_after
    assert error.code == ErrorCode.UNAVAILABLE and "prefill" in error.message, error
