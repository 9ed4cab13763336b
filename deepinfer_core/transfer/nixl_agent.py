"""One NIXL agent per engine process: registers the paged KV buffer and writes blocks to peers.

The cache is one region `[num_layers, num_blocks_total, *block]`, so (layer, block) sits at
`base + (layer * num_blocks_total + block) * block_bytes`. A hand-off writes every layer of
a request's blocks in ONE transfer; runs of consecutive block ids on both sides coalesce
into one descriptor per layer. Peers are added (and connected) once and cached: the
connection set-up (tens of ms) never sits on a request's path when `add_peer` is called at
registration time.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_core.transfer.layout import KVLayout

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """A posted WRITE."""

    handle: object
    peer: str
    num_bytes: int
    started: float
    error: str | None = None


class TransferError(RuntimeError):
    pass


class NixlKVAgent:
    def __init__(self, name_prefix: str, kv_buffer: torch.Tensor, layout: KVLayout, backend: str = "UCX"):
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: engines without P/D never import nixl

        self.name = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.buffer = kv_buffer
        self.mem_type = "VRAM" if kv_buffer.is_cuda else "DRAM"
        self.device_id = (kv_buffer.device.index or 0) if kv_buffer.is_cuda else 0
        self.base_addr = kv_buffer.data_ptr()
        self.num_blocks_total = int(kv_buffer.shape[1])
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=[backend]))
        self._reg = self._agent.register_memory(kv_buffer)
        self._peers: set[str] = set()
        self.bytes_sent = 0
        self.transfers_done = 0

    @property
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    # ---- peers -------------------------------------------------------------------------
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Learn a peer and connect to it (idempotent; cheap once the peer is known)."""
        if name in self._peers:
            return
        added = self._agent.add_remote_agent(metadata)
        added = added.decode() if isinstance(added, bytes) else added
        if added != name:
            raise TransferError(f"peer metadata names agent {added!r}, expected {name!r}")
        self._agent.make_connection(name)
        self._peers.add(name)

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            self._agent.remove_remote_agent(name)

    # ---- data plane ------------------------------------------------------------------------
    def write_blocks(
        self,
        peer: str,
        local_blocks: list[int],
        remote_base: int,
        remote_num_blocks_total: int,
        remote_blocks: list[int],
        remote_device_id: int = 0,
        remote_mem_type: str | None = None,
    ) -> Transfer:
        """Post a WRITE of `local_blocks` (all layers) into the peer's `remote_blocks`; does not wait."""
        if len(local_blocks) > len(remote_blocks):
            raise TransferError(f"{len(local_blocks)} blocks to send but only {len(remote_blocks)} reserved")
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}: add_peer() first")
        started = time.monotonic()  # posting may move data inline (shared-memory transports)
        runs = _coalesce(local_blocks, remote_blocks[: len(local_blocks)])
        bb, L = self.layout.block_bytes, self.layout.num_layers
        local = np.empty((L * len(runs), 3), dtype=np.uint64)
        remote = np.empty_like(local)
        i = 0
        for layer in range(L):
            for src, dst, n in runs:
                local[i] = (self.base_addr + (layer * self.num_blocks_total + src) * bb, n * bb, self.device_id)
                remote[i] = (remote_base + (layer * remote_num_blocks_total + dst) * bb, n * bb, remote_device_id)
                i += 1
        ldesc = self._agent.get_xfer_descs(local, self.mem_type)
        rdesc = self._agent.get_xfer_descs(remote, remote_mem_type or self.mem_type)
        handle = self._agent.initialize_xfer("WRITE", ldesc, rdesc, peer, b"")
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"posting the KV write to {peer} failed")
        return Transfer(handle, peer, int(local[:, 1].sum()), started)

    def poll(self, transfer: Transfer) -> str:
        """'DONE', 'PROC' or 'ERR' (a peer that went away reads as 'ERR', its reason in `transfer.error`)."""
        try:
            return self._agent.check_xfer_state(transfer.handle)
        except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT
            transfer.error = f"{type(e).__name__}: {e}"
            return "ERR"

    def wait(self, transfer: Transfer, timeout_s: float) -> None:
        """Block until the transfer completes; raises TransferError on error or timeout. Releases the handle."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                state = self.poll(transfer)
                if state == "DONE":
                    self.bytes_sent += transfer.num_bytes
                    self.transfers_done += 1
                    return
                if state == "ERR":
                    raise TransferError(f"KV write to {transfer.peer} failed: {transfer.error or 'transfer error'}")
                if time.monotonic() > deadline:
                    raise TransferError(f"KV write to {transfer.peer} did not complete within {timeout_s:.1f}s")
                time.sleep(0)  # yield; the progress thread moves the data
        finally:
            self.release(transfer)

    def release(self, transfer: Transfer) -> None:
        if transfer.handle is not None:
            try:
                self._agent.release_xfer_handle(transfer.handle)
            except Exception as e:  # a handle to a dead peer may refuse release; it is gone either way
                logger.warning("releasing a transfer handle to %s failed: %s", transfer.peer, e)
            transfer.handle = None

    # ---- control plane -----------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        for peer, messages in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((peer, m) for m in messages)
        return out

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


def _coalesce(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
