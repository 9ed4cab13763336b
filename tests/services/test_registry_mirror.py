"""`RegistryMirror`: a router's registry that follows another router's membership (each extra API
process of `deepinfer serve --api-workers N` follows the head's) — joins, drains and leaves as the
other router lists them, never connects PEs to CEs itself (the router they registered with did), does
not take back a worker it dropped for missed polls while the other still lists it unchanged, and
declares dead the workers the other router declared dead (that process of the id only)."""

import asyncio
import dataclasses

from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo
from services.router import registry as registry_module
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


def test_a_death_the_other_router_declared_is_declared_here_for_that_process_only():
    async def run():
        head, registry = PoolRegistry(RecordingClient), PoolRegistry(RecordingClient)
        mirror = RegistryMirror(registry)
        await head.add(PE, connect_peers=False)
        await mirror.apply([(PE, READY)])
        pe = registry.workers["pe-0"]  # what a reservation fenced against its writes waits on
        waiter = asyncio.ensure_future(registry.wait_dead(pe, 5.0))
        await head.remove("pe-0")
        head.declare_dead("pe-0")
        listed_dead = head.recently_dead()
        await mirror.apply([], listed_dead)
        freed = await waiter
        # the id registered again by a new process: a late copy of the old notice does not touch it
        await mirror.apply([(dataclasses.replace(PE, pid=99), READY)], listed_dead)
        return listed_dead, freed, registry.workers["pe-0"].dead.is_set(), registry.recently_dead()

    listed_dead, freed, new_one_dead, relayed = asyncio.run(run())
    assert listed_dead == [("pe-0", 10)] and freed and not new_one_dead
    assert relayed == [("pe-0", 10)]


def test_a_death_is_listed_for_a_while_then_forgotten(monkeypatch):
    async def run():
        head = PoolRegistry(RecordingClient)
        await head.add(PE, connect_peers=False)
        head.declare_dead("pe-0")
        head.declare_dead("nobody")  # never known: nothing to relay
        listed = head.recently_dead()
        monkeypatch.setattr(registry_module, "DEAD_LISTED_S", 0.0)
        return listed, head.recently_dead()

    assert asyncio.run(run()) == ([("pe-0", 10)], [])
