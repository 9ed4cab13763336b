"""The vision encoder worker's core and a prefill worker's embedding reads, over real NIXL (UCX
on loopback) and real threads, without gRPC: batching across requests, the encoder cache, and
the embedding pool returning to empty after a read, a release (the PE failed before reading),
a caller that went away mid-encode, and lease expiry; a lease renewed past its first end is still
read; the reader registers its buffer once."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.multimodal.encoder_config import EncoderConfig
from deepinfer_core.multimodal.encoder_runner import VisionEncoderRunner
from deepinfer_core.multimodal.processor import MultiModalProcessor
from services.common.errors import ErrorCode, ServiceError
from services.workers.embedding_fetcher import EmbeddingFetcher
from services.workers.encoder_core import EncoderCore
from tests.helpers.images import make_png

PNGS = [make_png(40, 36, seed=s) for s in range(6)]


@pytest.fixture(scope="module")
def model_config():
    return EngineArgs().create_model_config("cpu")


def _runner(model_config, **overrides) -> VisionEncoderRunner:
    config = EncoderConfig(**{"max_wait_s": 0.05, "lease_s": 30.0, **overrides})
    return VisionEncoderRunner.from_model_config(model_config, "cpu", config)


async def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return predicate()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_batched_encode_read_over_nixl_equals_in_process_and_empties_the_pool(model_config):
    async def main():
        runner = _runner(model_config)
        core = EncoderCore(runner, "ve-0")
        core.start()
        fetcher = EmbeddingFetcher("pe-0")
        try:
            # three requests at once: one batch of the tower (cache off the path: all distinct)
            handles = await asyncio.gather(*(core.encode(f"r{i}", [PNGS[i]]) for i in range(3)))
            assert runner.images_encoded == 3 and core.stats().embedding_leases == 3
            embeds, seconds = await fetcher.read([h for hs in handles for h in hs])
            registered = fetcher.registered_bytes
            assert await _until(lambda: runner.pool.leased == 0)  # the READs' notices freed the leases
            again = await core.encode("r3", [PNGS[0], PNGS[1]])  # cache hits: not encoded again
            assert runner.images_encoded == 3 and runner.cache_hits == 2
            await fetcher.read(again)
            assert fetcher.registered_bytes == registered  # the receive buffer was registered once
            assert await _until(lambda: runner.pool.leased == 0)
            return embeds, seconds, [h for hs in handles for h in hs]
        finally:
            core.stop()

    embeds, seconds, handles = _run(main())
    assert seconds > 0
    processor = MultiModalProcessor.for_model(_runner(model_config).encoder, model_config.path, torch.device("cpu"))
    want, want_hashes = processor.encode(PNGS[:3])
    for got, ref in zip(embeds, want):
        assert torch.equal(got, ref)
    # the PE keys the images' prefix-cache blocks by the encoder's hashes: those of an in-process encode
    assert [h.content_hash for h in handles] == want_hashes
    token = processor.image_token_id
    _, placeholders = processor.process([1, token, 2], {"image_embeds": embeds[:1], "image_hashes": want_hashes[:1]})
    assert placeholders[0].content_hash == want_hashes[0] and torch.equal(placeholders[0].embeds, want[0])


def test_leases_are_freed_by_release_expiry_and_a_caller_that_went_away(model_config):
    async def main():
        runner = _runner(model_config, lease_s=1.5)
        core = EncoderCore(runner, "ve-1")
        core.start()
        try:
            # the PE failed before reading: the router releases
            handles = await core.encode("failed", [PNGS[0], PNGS[1]])
            assert core.release([h.lease_id for h in handles]) == 2 and runner.pool.leased == 0
            # the client went away while its images were being encoded
            task = asyncio.ensure_future(core.encode("gone", [PNGS[2], PNGS[3], PNGS[4]]))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await _until(lambda: core.stats().encoder_queue_images == 0)
            assert await _until(lambda: runner.pool.leased == 0)
            # nobody reads nor releases: the lease expires (after its grace)
            await core.encode("forgotten", [PNGS[5]])
            assert runner.pool.leased == 1
            assert await _until(lambda: runner.pool.leased == 0, timeout_s=8.0)
            assert core.stats().requests == 0
        finally:
            core.stop()

    _run(main())


def test_a_renewed_lease_outlives_its_first_end_and_is_read_and_a_lapsed_one_is_not_renewed(model_config):
    async def main():
        runner = _runner(model_config)
        core = EncoderCore(runner, "ve-4")
        core.start()
        try:
            handles = await core.encode("waits", [PNGS[0]], lease_s=2.0)
            assert handles[0].expires_at < time.time() + 2.5  # the lease asked for, not the pool's 30 s
            waited_until = time.monotonic() + 5.0  # past the first end and the reuse grace (2 + 2 s)
            while time.monotonic() < waited_until:
                await asyncio.sleep(0.5)
                end = await core.renew_lease("waits", 2.0)
                assert end > time.time() + 1.5
            assert core.stats().embedding_leases == 1 and core.stats().embedding_lease_renewals >= 9
            renewed = [dataclasses.replace(h, expires_at=end) for h in handles]
            embeds, _ = await EmbeddingFetcher("pe-4").read(renewed)
            assert await _until(lambda: runner.pool.leased == 0)  # its notice freed it
            assert await core.renew_lease("waits", 2.0) == 0.0  # read: nothing to keep
            # a lease that lapsed is not brought back (its reader was told it is void)
            await core.encode("lapsed", [PNGS[1]], lease_s=0.3)
            await asyncio.sleep(0.5)
            assert await core.renew_lease("lapsed", 2.0) == 0.0
            assert await core.renew_lease("nobody", 2.0) == 0.0
            return embeds
        finally:
            core.stop()

    embeds = _run(main())
    processor = MultiModalProcessor.for_model(_runner(model_config).encoder, model_config.path, torch.device("cpu"))
    assert torch.equal(embeds[0], processor.encode(PNGS[:1])[0][0])


def test_a_read_of_an_expired_lease_is_a_clear_error(model_config):
    async def main():
        runner = _runner(model_config, lease_s=0.5)
        core = EncoderCore(runner, "ve-2")
        core.start()
        try:
            handles = await core.encode("late", [PNGS[0]])
            with pytest.raises(ServiceError) as err:
                await EmbeddingFetcher("pe-1").read(handles)
            assert err.value.code == ErrorCode.FAILED_PRECONDITION and "expired" in err.value.message
        finally:
            core.stop()

    _run(main())


def test_full_queue_and_full_pool_are_resource_exhausted_and_bad_images_invalid(model_config):
    async def main():
        runner = _runner(model_config, max_queue_images=2, pool_bytes=1)  # a pool of one slot
        core = EncoderCore(runner, "ve-3")
        core.start()
        try:
            with pytest.raises(ServiceError) as err:
                await core.encode("many", PNGS[:3])
            assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED and "queued" in err.value.message
            with pytest.raises(ServiceError) as err:
                await core.encode("two", PNGS[:2])
            assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED and runner.pool.leased == 0
            with pytest.raises(ServiceError) as err:
                await core.encode("bad", [b"not an image"])
            assert err.value.code == ErrorCode.INVALID_ARGUMENT
            assert len(await core.encode("one", PNGS[:1])) == 1 and core.health()[0]
        finally:
            core.stop()

    _run(main())
