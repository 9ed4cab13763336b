"""Registration over gRPC: when a CE joins, each PE connects to it and prepares its transfer
descriptors then, so no request pays for them. A real PE and CE (worker servers in this
process, real NIXL agents) behind the router's registry and `GrpcWorkerClient`."""

import asyncio
import dataclasses
import logging

import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from services.common.messages import info_from_proto, info_to_proto  # noqa: E402
from services.common.workers import POOL_DECODE, POOL_PREFILL  # noqa: E402
from services.router.clients import GrpcWorkerClient  # noqa: E402
from services.router.registry import PoolRegistry  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import WorkerServer  # noqa: E402

ARGS = EngineSettings(device="cpu", num_gpu_blocks=64, max_model_len=128, block_size=8)


@pytest.fixture(scope="module")
def workers():
    pe = WorkerServer(WorkerSpec("pe-0", POOL_PREFILL, ARGS, metrics=False))
    ce = WorkerServer(WorkerSpec("ce-0", POOL_DECODE, ARGS, metrics=False))
    pe.start(), ce.start()
    yield pe, ce
    pe.stop(), ce.stop()


def test_a_joining_ce_is_prepared_on_every_pe_and_a_foreign_layout_is_refused(workers, caplog):
    pe, ce = workers
    agent = pe.core.engine.agent
    assert ce.info.kv_region == ce.core.engine.agent.region
    foreign = dataclasses.replace(ce.info.kv_region, fingerprint="0" * 20, layout="SomeOtherModel")
    forged = dataclasses.replace(ce.info, worker_id="ce-foreign", kv_region=foreign)

    async def run():
        registry = PoolRegistry(GrpcWorkerClient)
        try:
            await registry.add(pe.info)
            await registry.add(forged)  # what Register hands the registry
            assert agent.num_remote_lists == 0
            await registry.add(info_from_proto(info_to_proto(ce.info)))
        finally:
            await registry.close()

    with caplog.at_level(logging.WARNING, logger="services.router.registry"):
        asyncio.run(run())
    assert agent.num_remote_lists == 1  # before any request
    assert "could not connect pe-0 to ce-foreign" in caplog.text and "KV layout mismatch" in caplog.text
