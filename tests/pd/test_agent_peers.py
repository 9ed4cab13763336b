"""A peer added with its KV region has its descriptor list prepared then, not at the first write."""

import pytest
import torch

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from deepinfer_core.transfer.layout import KVLayout  # noqa: E402
from deepinfer_core.transfer.nixl_agent import NixlKVAgent, TransferError  # noqa: E402


def _agent(name: str, buf: torch.Tensor) -> NixlKVAgent:
    return NixlKVAgent(name, buf, KVLayout.of({"architectures": ["Peers"]}, buf, 4))


@pytest.fixture
def agents(monkeypatch):
    """A writer (local list prepared, remote preparations counted) and two peers: [2 layers, blocks, 4, 2]."""
    src = torch.arange(2 * 8 * 4 * 2, dtype=torch.float32).reshape(2, 8, 4, 2)
    writer, ce, old_ce = (
        _agent("pe", src),
        _agent("ce", torch.zeros(2, 6, 4, 2)),
        _agent("old", torch.zeros(2, 5, 4, 2)),
    )
    writer.prepare_writes()
    prepared = []
    real = writer._agent.prep_xfer_dlist
    monkeypatch.setattr(
        writer._agent, "prep_xfer_dlist", lambda peer, descs: prepared.append(peer) or real(peer, descs)
    )
    yield writer, ce, old_ce, prepared
    for agent in (writer, ce, old_ce):
        agent.close()


def _write(writer: NixlKVAgent, peer: NixlKVAgent, local: list[int], remote: list[int]) -> None:
    r = peer.region
    writer.wait(
        writer.write_blocks(peer.name, local, r.base_addr, r.num_blocks_total, remote, r.device_id, r.mem_type), 10
    )


def test_add_peer_with_its_region_prepares_the_list_and_writes_reuse_it(agents):
    writer, ce, _, prepared = agents
    writer.add_peer(ce.name, ce.metadata, ce.region)
    assert prepared == [ce.name] and writer.num_remote_lists == 1  # before any write
    writer.add_peer(ce.name, ce.metadata, ce.region)  # idempotent
    _write(writer, ce, [1, 3], [5, 0])
    assert prepared == [ce.name] and writer.num_remote_lists == 1  # the write built no list
    assert torch.equal(ce.buffer[:, 5], writer.buffer[:, 1]) and torch.equal(ce.buffer[:, 0], writer.buffer[:, 3])


def test_a_peer_without_its_region_is_prepared_at_the_first_write(agents):
    writer, _, old_ce, prepared = agents
    with pytest.raises(TransferError, match="unknown peer"):
        writer.prepare_peer(old_ce.name, old_ce.region)
    writer.add_peer(old_ce.name, old_ce.metadata)  # an older router: no region
    assert prepared == [] and writer.num_remote_lists == 0
    _write(writer, old_ce, [2], [4])
    _write(writer, old_ce, [6], [1])
    assert prepared == [old_ce.name] and writer.num_remote_lists == 1  # the lazy fallback, once
    assert torch.equal(old_ce.buffer[:, 4], writer.buffer[:, 2]) and torch.equal(
        old_ce.buffer[:, 1], writer.buffer[:, 6]
    )
    writer.remove_peer(old_ce.name)
    assert writer.num_remote_lists == 0


def test_a_prepared_write_reads_the_blocks_when_posted_and_is_spent_once(agents):
    """A PE prepares while the forward still writes the blocks: the data sent is what the
    buffer holds at `post`, and a request posts (or is discarded) once."""
    writer, ce, _, _ = agents
    writer.add_peer(ce.name, ce.metadata, ce.region)
    r = ce.region
    write = writer.prepare_write(ce.name, [2, 4], r.base_addr, r.num_blocks_total, [1, 3], layers=range(1, 2))
    assert write.num_bytes == 2 * writer.layout.block_bytes  # one layer of two blocks
    writer.buffer[1, 2].fill_(-7.0)  # written after the request was made, before it is posted
    writer.wait(writer.post(write), 10)
    assert torch.equal(ce.buffer[1, 1], torch.full((4, 2), -7.0)) and torch.equal(ce.buffer[1, 3], writer.buffer[1, 4])
    assert not ce.buffer[0].any()  # the other layer was not part of the write
    with pytest.raises(TransferError, match="posted twice"):
        writer.post(write)
    spare = writer.prepare_write(ce.name, [5], r.base_addr, r.num_blocks_total, [2])
    writer.discard(spare)
    writer.discard(spare)  # idempotent
    with pytest.raises(TransferError, match="after discard"):
        writer.post(spare)
    assert not ce.buffer[:, 2].any()  # a discarded request moves nothing
    with pytest.raises(TransferError, match="only 1 reserved"):
        writer.prepare_write(ce.name, [1, 2], r.base_addr, r.num_blocks_total, [0])
