"""`RegistryMirror`: a router's registry that follows another router's membership (each extra API
process of `deepinfer serve --api-workers N` follows the head's) — joins, drains and leaves as the
other router lists them, never connects PEs to CEs itself (the router they registered with did), and
does not take back a worker it dropped for missed polls while the other still lists it unchanged."""

import asyncio
import dataclasses

from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo
from services.router.registry import DRAINING, READY, PoolRegistry, RegistryMirror

PE = WorkerInfo("pe-0", POOL_PREFILL, 2, "127.0.0.1:1", pid=10)
CE = WorkerInfo("ce-0", POOL_DECODE, 3, "127.0.0.1:2", agent_name="ce-agent", pid=11)


class RecordingClient:
    """Stands for a worker's client: records what the registry asks of it."""

    def __init__(self, info: WorkerInfo):
        self.info = info
        self.calls: list[str] = []

    async def connect_peer(self, agent_name, metadata, region=None) -> None:
        self.calls.append(f"connect {agent_name}")

    async def close(self) -> None:
        self.calls.append("close")


def test_the_mirror_follows_joins_drains_and_leaves_without_connecting_peers():
    async def run():
        clients: list[RecordingClient] = []
        registry = PoolRegistry(lambda info: clients.append(RecordingClient(info)) or clients[-1])
        mirror = RegistryMirror(registry)
        await mirror.apply([(PE, READY), (CE, READY)])
        joined = sorted(registry.workers)
        await mirror.apply([(PE, READY), (CE, DRAINING)])
        drained = registry.workers["ce-0"].state
        await mirror.apply([(PE, READY)])
        return joined, drained, sorted(registry.workers), [c.calls for c in clients]

    joined, drained, left, calls = asyncio.run(run())
    assert joined == ["ce-0", "pe-0"] and drained == DRAINING and left == ["pe-0"]
    assert calls == [[], ["close"]]  # the PE was never told to connect: the head's router did that


def test_a_worker_dropped_for_missed_polls_stays_out_until_it_registers_again():
    async def run():
        registry = PoolRegistry(RecordingClient)
        mirror = RegistryMirror(registry)
        await mirror.apply([(CE, READY)])
        await registry.remove("ce-0")  # what missed polls do
        await mirror.apply([(CE, READY)])
        while_listed_unchanged = "ce-0" in registry.workers
        await mirror.apply([(dataclasses.replace(CE, pid=12), READY)])  # the worker came back
        return while_listed_unchanged, "ce-0" in registry.workers

    assert asyncio.run(run()) == (False, True)
