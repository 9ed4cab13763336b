"""The head's front door without Ray: `Head.start_front()` serves the router and the gateway,
worker servers started beside it (one with an engine built outside) register at
`head.router_address`, and a completion through `head.http_url` equals the NORMAL engine's."""

import asyncio

import httpx

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from services.common.workers import POOL_DECODE, POOL_PREFILL  # noqa: E402
from services.controller.head import Head  # noqa: E402
from services.controller.serve_config import HeadConfig  # noqa: E402
from services.workers.spec import EngineSettings, WorkerSpec  # noqa: E402
from services.workers.worker_server import WorkerServer, build_engine  # noqa: E402

ENGINE = dict(device="cpu", num_gpu_blocks=64, max_model_len=128, block_size=8)
ARGS = EngineSettings(**ENGINE)


def test_workers_of_their_own_register_with_a_front_only_head():
    config = HeadConfig(port=0, grpc_port=0, engine_args=ARGS)
    body = {"prompt": "Hello, my name is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def run():
        head = Head(config)
        await head.start_front()
        specs = [
            WorkerSpec(
                name, pool, ARGS, router_address=head.router_address, cluster_token=config.cluster_token, metrics=False
            )
            for name, pool in (("ce-0", POOL_DECODE), ("pe-0", POOL_PREFILL))
        ]
        workers = [WorkerServer(specs[0]), WorkerServer(specs[1], engine=build_engine(specs[1]))]
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                assert (await client.get(f"{head.http_url}/health")).status_code == 503  # no workers yet
                for w in workers:
                    await asyncio.to_thread(w.start)
                health = await client.get(f"{head.http_url}/health")
                reply = await client.post(f"{head.http_url}/v1/completions", json=body)
            return health.status_code, reply.json(), head.grpc_address
        finally:
            for w in workers:
                await asyncio.to_thread(w.stop)
            await head.stop()

    health, reply, grpc_address = asyncio.run(run())
    want = LLM(**ENGINE).generate(body["prompt"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert health == 200 and grpc_address
    assert reply["choices"][0]["text"] == want.outputs[0].text
