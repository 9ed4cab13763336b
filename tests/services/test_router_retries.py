"""Which prefill failures the router retries: only those that may succeed on another worker.
Fake workers behind the real RouterCore, so each failure code can be forced."""

import asyncio

import pytest
from prometheus_client import REGISTRY

from deepinfer_core import SamplingParams
from deepinfer_core.transfer.messages import KVTarget
from services.common.errors import ErrorCode, ServiceError
from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo, WorkerLoad
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry


class FakeWorker:
    """A CE that reserves anything and a PE whose every prefill fails with `code`."""

    def __init__(self, code: ErrorCode):
        self.code = code
        self.prefills = 0

    async def reserve(self, request_id, prompt, params, lease_s, timeout) -> KVTarget:
        return KVTarget(request_id, "ce", b"", 0, 1, 0, "DRAM", [0], "f", len(prompt))

    async def prefill(self, request_id, prompt, params, kv_target, timeout, images=(), resumed_tokens=0):
        self.prefills += 1
        raise ServiceError(self.code, f"refused with {self.code.name}")

    async def abort(self, request_id, prefill) -> bool:
        return False

    async def stats(self, timeout) -> WorkerLoad:
        return WorkerLoad()

    async def close(self) -> None:
        pass


def router_retries() -> float:
    """`deepinfer:router_retries_total` of this process, every reason."""
    return sum(
        s.value
        for metric in REGISTRY.collect()
        if metric.name == "deepinfer:router_retries"
        for s in metric.samples
        if s.name.endswith("_total")
    )


def _fail_prefill(code: ErrorCode) -> tuple[ServiceError, int]:
    """Run one request against a PE that fails with `code`; the router's error and the PE's calls."""
    worker = FakeWorker(code)

    async def run():
        registry = PoolRegistry(lambda info: worker)
        for pool, name in ((POOL_DECODE, "ce-0"), (POOL_PREFILL, "pe-0")):
            info = WorkerInfo(name, pool, 0, "fake", max_model_len=256, block_size=8, num_blocks=64, max_num_seqs=8)
            await registry.add(info)
        router = RouterCore(registry, RouterConfig(pools=(POOL_PREFILL, POOL_DECODE), admission_timeout_s=0.2))
        with pytest.raises(ServiceError) as e:
            async for _ in router.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                pass
        await router.stop()
        return e.value

    return asyncio.run(run()), worker.prefills


def test_a_request_the_prefill_engine_refuses_as_invalid_is_not_retried():
    before = router_retries()
    error, prefills = _fail_prefill(ErrorCode.INVALID_ARGUMENT)
    assert error.code is ErrorCode.INVALID_ARGUMENT and "refused with INVALID_ARGUMENT" in error.message
    assert prefills == 1 and router_retries() == before


def test_a_failed_transfer_is_retried_up_to_the_attempt_limit():
    before = router_retries()
    error, prefills = _fail_prefill(ErrorCode.INTERNAL)
    attempts = RouterConfig().max_prefill_attempts
    assert error.code is ErrorCode.UNAVAILABLE and f"prefill failed {attempts} times" in error.message
    assert prefills == attempts and router_retries() == before + attempts
