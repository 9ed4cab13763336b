"""RouterCore and a worker core driven in one process, without gRPC or Ray: a real NORMAL
engine on its engine thread behind `LocalWorkerClient`."""

import asyncio

import pytest

from deepinfer_core import LLM, SamplingParams
from services.common.errors import ErrorCode, ServiceError
from services.common.limits import RequestLimits
from services.common.workers import POOL_COLOCATED, WorkerInfo
from services.router.clients import LocalWorkerClient
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry
from services.workers.decode_core import DecodeCore
from services.workers.spec import EngineSettings, WorkerSpec
from services.workers.worker_server import build_engine

ARGS = dict(device="cpu", num_gpu_blocks=128, max_model_len=256, block_size=8)


async def _router(**config) -> tuple[RouterCore, DecodeCore]:
    core = DecodeCore(build_engine(WorkerSpec("normal-0", POOL_COLOCATED, EngineSettings(**ARGS))), "normal-0")
    core.start()
    registry = PoolRegistry(lambda info: LocalWorkerClient(core))
    info = WorkerInfo(
        "normal-0", POOL_COLOCATED, 0, "local", max_model_len=256, block_size=8, num_blocks=128, max_num_seqs=64
    )
    await registry.add(info)
    return RouterCore(registry, RouterConfig(pools=(POOL_COLOCATED,), **config)), core


async def _collect(router: RouterCore, prompt, params) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for delta in router.generate("r", prompt, params):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return tokens


def test_fan_out_merges_samples_equal_to_the_engine():
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(n=3, temperature=0, max_tokens=7, ignore_eos=True)
    want = LLM(**ARGS).generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]

    async def run():
        router, core = await _router()
        try:
            return await _collect(router, prompt, params)
        finally:
            core.stop()

    assert asyncio.run(run()) == {i: want.outputs[0].token_ids for i in range(3)}


def test_leaving_early_aborts_the_request_on_the_engine():
    async def run():
        router, core = await _router()
        try:
            stream = router.generate("early", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            async for delta in stream:
                if delta.token_ids:
                    break
            await stream.aclose()
            for _ in range(200):
                if core.stats().requests == 0 and not core.streams:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            return core.stats()
        finally:
            core.stop()

    load = asyncio.run(run())
    assert load.requests == 0 and load.free_blocks == load.num_blocks


def test_bad_requests_and_missing_pools_fail_with_codes():
    async def run():
        router, core = await _router(limits=RequestLimits(max_n=2), admission_timeout_s=0.2)
        errors = []
        try:
            for prompt, params in (
                ([1, 2], SamplingParams(n=3)),
                (list(range(1, 300)), SamplingParams()),
                ([], SamplingParams()),
            ):
                with pytest.raises(ServiceError) as e:
                    await _collect(router, prompt, params)
                errors.append(e.value.code)
            assert router.ready() == (True, "ok")
            await router.registry.remove("normal-0")
            assert not router.ready()[0]
            with pytest.raises(ServiceError) as e:
                await _collect(router, [1, 2], SamplingParams(max_tokens=2))
            errors.append(e.value.code)
        finally:
            core.stop()
        return errors

    assert asyncio.run(run()) == [ErrorCode.INVALID_ARGUMENT] * 3 + [ErrorCode.UNAVAILABLE]
