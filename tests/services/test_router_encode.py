"""The router's E step, fake workers behind the real RouterCore: images go to the encoder first
and their leases to the PE; a PE that could not read the embeddings gets them encoded once more,
then the request ends with a clear error; leases no PE read are released; text-only requests
skip the encoder; a full encoder is a 429 once the admission deadline passes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.config import PDConfig
from deepinfer_core.multimodal.embedding_handle import EMBEDDINGS_UNAVAILABLE, EmbeddingHandle
from deepinfer_core.transfer.messages import KVTarget
from services.common.deltas import SampleDelta
from services.common.errors import ErrorCode, ServiceError
from services.common.prefill_result import PrefillResult
from services.common.workers import POOL_DECODE, POOL_ENCODER, POOL_PREFILL, WorkerInfo, WorkerLoad
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry

IMAGE = b"\x89PNG..."  # the fakes never decode it


class Fakes:
    """One CE, one PE whose first `lost_reads` prefills cannot read their embeddings, one VE."""

    def __init__(self, lost_reads: int = 0, encoder_full: bool = False):
        self.lost_reads = lost_reads
        self.encoder_full = encoder_full
        self.encodes = 0
        self.prefill_images: list[list] = []
        self.leased: set[int] = set()
        self._ids = itertools.count(1)

    async def encode(self, request_id, images, timeout, lease_s=0.0) -> list[EmbeddingHandle]:
        if self.encoder_full:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "the embedding pool is full")
        self.encodes += 1
        handles = [EmbeddingHandle("ve", b"", 0, 8, (2, 1), "float32", 7, next(self._ids), 0.0) for _ in images]
        self.leased |= {h.lease_id for h in handles}
        return handles

    async def release(self, lease_ids) -> int:
        freed = self.leased & set(lease_ids)
        self.leased -= freed
        return len(freed)

    async def renew_lease(self, request_id, prefill, lease_s, expires_at, timeout) -> float:
        return 0.0  # these requests never wait for a heartbeat

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        return KVTarget(request_id, "ce", b"", 0, 1, 0, "DRAM", [0], "f", len(prompt))

    async def prefill(
        self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0
    ) -> PrefillResult:
        self.prefill_images.append(list(images))
        if len(self.prefill_images) <= self.lost_reads:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"pe-0: {EMBEDDINGS_UNAVAILABLE}: lease expired")
        self.leased -= {h.lease_id for h in images if isinstance(h, EmbeddingHandle)}  # the READ's notice
        return PrefillResult(SampleDelta(token_ids=[5], text="x"))

    async def stream(self, request_id, timeout):
        yield SampleDelta(token_offset=1, token_ids=[6], text_offset=1, text="y", finish_reason="length")

    async def abort(self, request_id, prefill) -> bool:
        return False

    async def stats(self, timeout) -> WorkerLoad:
        return WorkerLoad()

    async def close(self) -> None:
        pass


def _run(fakes: Fakes, images: list[bytes], local_prefill_tokens: int = 0) -> list[int] | ServiceError:
    async def run():
        registry = PoolRegistry(lambda info: fakes)
        for pool, name in ((POOL_DECODE, "ce-0"), (POOL_PREFILL, "pe-0"), (POOL_ENCODER, "ve-0")):
            info = WorkerInfo(name, pool, 0, "fake", max_model_len=256, block_size=8, num_blocks=64, max_num_seqs=8)
            await registry.add(info)
        pd = PDConfig(local_prefill_tokens=local_prefill_tokens)
        config = RouterConfig(pools=(POOL_PREFILL, POOL_DECODE, POOL_ENCODER), admission_timeout_s=0.3, pd=pd)
        router = RouterCore(registry, config, "m")
        try:
            stream = router.generate("r", [1, 2, 3], SamplingParams(max_tokens=2), images=images)
            return [t async for d in stream for t in d.token_ids]
        except ServiceError as e:
            return e
        finally:
            await router.stop()

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize("local_prefill_tokens", [0, 1000])
def test_images_are_encoded_first_and_their_leases_go_to_the_pe(local_prefill_tokens):
    """Even where short prompts are prefilled on the decode engine (which encodes no image)."""
    fakes = Fakes()
    assert _run(fakes, [IMAGE, IMAGE], local_prefill_tokens) == [5, 6]
    assert fakes.encodes == 1 and [len(i) for i in fakes.prefill_images] == [2]
    assert all(isinstance(h, EmbeddingHandle) for h in fakes.prefill_images[0]) and not fakes.leased


def test_a_lost_read_is_encoded_again_once_then_a_clear_error():
    fakes = Fakes(lost_reads=1)
    assert _run(fakes, [IMAGE]) == [5, 6]
    assert fakes.encodes == 2 and not fakes.leased  # the unread first lease was released
    fakes = Fakes(lost_reads=5)
    error = _run(fakes, [IMAGE])
    assert isinstance(error, ServiceError) and error.code is ErrorCode.UNAVAILABLE
    assert EMBEDDINGS_UNAVAILABLE in error.message and fakes.encodes == 2 and not fakes.leased


def test_text_only_requests_skip_the_encoder():
    fakes = Fakes()
    assert _run(fakes, []) == [5, 6]
    assert fakes.encodes == 0 and fakes.prefill_images == [[]]


@pytest.mark.parametrize("images", [[IMAGE]])
def test_a_full_encoder_is_resource_exhausted_after_the_admission_deadline(images):
    error = _run(Fakes(encoder_full=True), images)
    assert isinstance(error, ServiceError) and error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "encoder" in error.message
