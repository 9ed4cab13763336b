"""One NIXL agent per engine process: registers the paged KV buffer and writes blocks to peers.

The cache is one region `[num_layers, num_blocks_total, *block]`, so (layer, block) sits at
`base + (layer * num_blocks_total + block) * block_bytes`. One transfer writes a run of a
request's blocks across all layers, or across a range of layers (a PE sends the last chunk in
layer groups as the forward writes them). Descriptor lists of every (layer, block) region are
prepared once and a transfer is made from indices into them (NIXL merges neighbouring
regions): building a request from fresh descriptors costs microseconds per descriptor on the
posting thread, which fragmented block tables would put on every hand-off. Preparing a list
takes a noticeable fraction of a second at production cache sizes (millions of layer-block
regions), so neither list is built on a request's path: the local one when a writer starts (`prepare_writes`), a peer's
when the peer is added with its `KVRegion` (`add_peer(..., region)` at registration time).
A write to a peer region not announced that way (a CE registered without its region, an
older router) prepares the list then, once. Peers are added (and connected) once and cached:
the connection set-up (tens of ms) never sits on a request's path either.

Progress. Polling a transfer or the notices drives the agent's UCX worker on the calling
thread, and the engines poll between steps (`progress()`). A receiving agent keeps NIXL's
progress thread: it sleeps on the worker's event descriptor and answers a writer's completion
handshake and notices at once, which a poll between the receiver's steps would delay by up to
a turn (a large WRITE to a receiver polling between steps took about twice as long). A sending
agent of a GPU cache runs without one, since it polls while it waits for its writes anyway, and
the thread competes with that: with NIXL's thread spinning in the sender (its Python default),
back-to-back WRITEs between two GPUs were markedly slower than without it, which matched a
peer-to-peer `copy_`. With the pause the engines set the cost is within run-to-run noise, but
nothing is gained by the thread there. The figures: docs/benchmarks.md, "Figures formerly in
code".
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_core import envs
from deepinfer_core.errors import TransferError
from deepinfer_core.transfer.agent_settings import keep_one_libibverbs, progress_thread_delay, wants_progress_thread
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.messages import KVRegion

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """A posted WRITE."""

    handle: object
    peer: str
    num_bytes: int
    started: float
    error: str | None = None


@dataclass
class PreparedWrite:
    """A WRITE's request, made but not yet posted (`NixlKVAgent.prepare_write`)."""

    handle: object
    peer: str
    num_bytes: int


class NixlKVAgent:
    def __init__(
        self, name_prefix: str, kv_buffer: torch.Tensor, layout: KVLayout, backend: str = "UCX", sends: bool = False
    ):
        """`sends`: this agent writes KV to peers (a PE), which decides its progress thread."""
        keep_one_libibverbs()
        from deepinfer_core.transfer.nixl_variant import api  # lazy: engines without P/D never import nixl

        nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config

        self.name = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
        self.layout = layout
        self.buffer = kv_buffer
        self.mem_type = "VRAM" if kv_buffer.is_cuda else "DRAM"
        self.device_id = (kv_buffer.device.index or 0) if kv_buffer.is_cuda else 0
        self.base_addr = kv_buffer.data_ptr()
        self.num_blocks_total = int(kv_buffer.shape[1])
        self.progress_thread = wants_progress_thread(self.mem_type, sends)
        if sends and self.mem_type == "VRAM":
            # UCX's scatter-gather offload posts a write's per-layer runs as one batched copy: the
            # post call is shorter, the bandwidth of whole hand-offs unchanged (docs/benchmarks.md,
            # "Figures formerly in code"). NIXL reads this when the backend is made. A value the
            # operator set wins.
            os.environ.setdefault("NIXL_UCX_SGL_ENABLE", "1")
        with progress_thread_delay(envs.DEEPINFER_NIXL_PROGRESS_DELAY_US):
            config = nixl_agent_config(enable_prog_thread=self.progress_thread, backends=[backend])
            self._agent = nixl_agent(self.name, config)
        self._notifs: list[tuple[str, bytes]] = []  # read while driving progress, not yet taken
        self._rows: dict[int, np.ndarray] = {}
        self._reg = self._agent.register_memory(kv_buffer)
        self._peers: set[str] = set()
        self._local_dlist = None
        self._remote_dlists: dict[tuple, object] = {}  # (peer, base, blocks, device, mem) -> prepped handle
        self.bytes_sent = 0
        self.transfers_done = 0

    @property
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    @property
    def region(self) -> KVRegion:
        """This agent's KV buffer as a peer addresses it (what a CE publishes at registration)."""
        return KVRegion(
            self.base_addr,
            self.num_blocks_total,
            self.device_id,
            self.mem_type,
            self.layout.fingerprint,
            self.layout.describe(),
        )

    @property
    def peers(self) -> frozenset[str]:
        """Names of the connected peers."""
        return frozenset(self._peers)

    @property
    def num_remote_lists(self) -> int:
        """Peer descriptor lists prepared so far (one per peer region)."""
        return len(self._remote_dlists)

    # ---- peers -------------------------------------------------------------------------
    def add_peer(self, name: str, metadata: bytes, region: KVRegion | None = None) -> None:
        """Learn a peer and connect to it (idempotent; cheap once the peer is known).

        Args:
            region: the peer's KV buffer; when given, its descriptor list is prepared now
                (`prepare_peer`) rather than at the first write to it.
        """
        if name not in self._peers:
            added = self._agent.add_remote_agent(metadata)
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise TransferError(f"peer metadata names agent {added!r}, expected {name!r}")
            self._agent.make_connection(name)
            self._peers.add(name)
        if region is not None:
            self.prepare_peer(name, region)

    def prepare_peer(self, name: str, region: KVRegion) -> None:
        """Prepare the descriptor list of a known peer's KV `region` now (idempotent): the
        first write to it then costs no list building. Raises TransferError for an unknown peer."""
        if name not in self._peers:
            raise TransferError(f"unknown peer {name!r}: add_peer() first")
        self._remote_handle(name, region.base_addr, region.num_blocks_total, region.device_id, region.mem_type)

    def remove_peer(self, name: str) -> None:
        for key in [k for k in self._remote_dlists if k[0] == name]:
            try:
                self._agent.release_dlist_handle(self._remote_dlists.pop(key))
            except Exception as e:  # a vanished peer's list may refuse release; it is unusable either way
                logger.warning("releasing the descriptor list of %s failed: %s", name, e)
        if name in self._peers:
            self._peers.discard(name)
            self._agent.remove_remote_agent(name)

    # ---- prepared descriptor lists ---------------------------------------------------------
    def _regions(self, base: int, num_blocks_total: int, device_id: int) -> np.ndarray:
        """(addr, bytes, device) of every (layer, block) region, index = layer * num_blocks_total + block."""
        bb, n = self.layout.block_bytes, self.layout.num_layers * num_blocks_total
        addrs = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
        return np.stack([addrs, np.full(n, bb, dtype=np.uint64), np.full(n, device_id, dtype=np.uint64)], axis=1)

    def prepare_writes(self) -> None:
        """Prepare the local descriptor list now (a writer calls this at start-up): at production
        cache sizes (~1.8 M layer-block regions) building it takes ~0.1-0.2 s, which would
        otherwise land on the first hand-off's time-to-first-token."""
        self._local_handle()

    def _local_handle(self):
        if self._local_dlist is None:
            regions = self._regions(self.base_addr, self.num_blocks_total, self.device_id)
            descs = self._agent.get_xfer_descs(regions, self.mem_type)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs)
        return self._local_dlist

    def _remote_handle(self, peer: str, base: int, num_blocks_total: int, device_id: int, mem_type: str):
        """The peer region's prepared list: from `prepare_peer`, else built now (the lazy fallback)."""
        key = (peer, base, num_blocks_total, device_id, mem_type)
        handle = self._remote_dlists.get(key)
        if handle is None:
            descs = self._agent.get_xfer_descs(self._regions(base, num_blocks_total, device_id), mem_type)
            handle = self._remote_dlists[key] = self._agent.prep_xfer_dlist(peer, descs)
        return handle

    # ---- data plane ------------------------------------------------------------------------
    def write_blocks(self, *args, **kwargs) -> Transfer:
        """Post a WRITE of `local_blocks` (of `layers`, default all) into the peer's `remote_blocks`;
        does not wait. `prepare_write` (same arguments) and `post` in one call."""
        return self.post(self.prepare_write(*args, **kwargs))

    def prepare_write(
        self,
        peer: str,
        local_blocks: list[int],
        remote_base: int,
        remote_num_blocks_total: int,
        remote_blocks: list[int],
        remote_device_id: int = 0,
        remote_mem_type: str | None = None,
        layers: range | None = None,
    ) -> PreparedWrite:
        """Make the WRITE's request without moving anything: the blocks may still be computing.
        A PE prepares its hand-offs while the forward runs and only posts them after it, which
        takes the index building and NIXL's request set-up (a measurable share of a small hand-off
        between two GPUs) off time-to-first-token. `post` or `discard` it."""
        if len(local_blocks) > len(remote_blocks):
            raise TransferError(f"{len(local_blocks)} blocks to send but only {len(remote_blocks)} reserved")
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}: add_peer() first")
        rows = slice(None) if layers is None else slice(layers.start, layers.stop, layers.step)
        src = np.asarray(local_blocks, dtype=np.int32)
        dst = np.asarray(remote_blocks[: len(local_blocks)], dtype=np.int32)
        remote = self._remote_handle(
            peer, remote_base, remote_num_blocks_total, remote_device_id, remote_mem_type or self.mem_type
        )
        local_rows = self._layer_rows(self.num_blocks_total)[rows]
        # (layer, block) -> its index in a prepared list; int32 is what nixl reads without a
        # conversion pass (int64 indices took about twice as long; docs/benchmarks.md)
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            self._local_handle(),
            (local_rows + src).ravel(),
            remote,
            (self._layer_rows(remote_num_blocks_total)[rows] + dst).ravel(),
        )
        return PreparedWrite(handle, peer, len(local_rows) * len(local_blocks) * self.layout.block_bytes)

    def post(self, prepared: PreparedWrite) -> Transfer:
        """Start a prepared WRITE; does not wait. The request is spent either way."""
        handle, prepared.handle = prepared.handle, None
        if handle is None:
            raise TransferError(f"a write to {prepared.peer} was posted twice or after discard()")
        started = time.monotonic()  # posting may move data inline (shared-memory transports)
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # a peer that went away can fail at post time
            self._release_handle(handle, prepared.peer)
            raise TransferError(f"posting the KV write to {prepared.peer} failed: {e}") from e
        if state == "ERR":
            self._release_handle(handle, prepared.peer)
            raise TransferError(f"posting the KV write to {prepared.peer} failed")
        return Transfer(handle, prepared.peer, prepared.num_bytes, started)

    def discard(self, prepared: PreparedWrite) -> None:
        """Release a prepared WRITE that will not be posted (idempotent)."""
        handle, prepared.handle = prepared.handle, None
        if handle is not None:
            self._release_handle(handle, prepared.peer)

    def _layer_rows(self, num_blocks_total: int) -> np.ndarray:
        """`[num_layers, 1]` int32: the prepared-list index of (layer, block 0) in a cache of
        `num_blocks_total` blocks, kept per cache size (a hand-off's posting runs on the step's
        path: building them each time took about a third of a 64 MiB hand-off's posting)."""
        rows = self._rows.get(num_blocks_total)
        if rows is None:
            rows = np.arange(self.layout.num_layers, dtype=np.int64) * num_blocks_total
            if rows[-1] + num_blocks_total > np.iinfo(np.int32).max:
                raise TransferError(f"{rows[-1] + num_blocks_total} layer-block regions exceed int32 indices")
            rows = self._rows[num_blocks_total] = rows.astype(np.int32)[:, None]
        return rows

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
            while not self._settle(transfer):
                if time.monotonic() > deadline:
                    raise TransferError(f"KV write to {transfer.peer} did not complete within {timeout_s:.1f}s")
                time.sleep(0)  # yield to other threads; polling drives the transfer
        finally:
            self.release(transfer)

    def reap(self, transfer: Transfer) -> bool:
        """Non-blocking: True (and the handle released) once the transfer is DONE, False while it
        runs; raises TransferError (handle released) if it failed."""
        return self._settle(transfer)

    def _settle(self, transfer: Transfer) -> bool:
        state = self.poll(transfer)
        if state == "PROC":
            return False
        self.release(transfer)
        if state != "DONE":
            raise TransferError(f"KV write to {transfer.peer} failed: {transfer.error or 'transfer error'}")
        self.bytes_sent += transfer.num_bytes
        self.transfers_done += 1
        return True

    def release(self, transfer: Transfer) -> None:
        if transfer.handle is not None:
            self._release_handle(transfer.handle, transfer.peer)
            transfer.handle = None

    def _release_handle(self, handle, peer: str) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # a handle to a dead peer may refuse release; it is gone either way
            logger.warning("releasing a transfer handle to %s failed: %s", peer, e)

    # ---- control plane -----------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)
        self.progress()  # one round for a notice the transport could not send at once; loop turns do the rest

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._read_notifs()
        out, self._notifs = self._notifs, []
        return out

    def progress(self) -> None:
        """Drive the UCX worker once (connection set-up, notices still queued to go out) where no
        progress thread does; engines call it between steps. Notices read meanwhile are kept
        for `get_notifs`."""
        if not self.progress_thread:
            self._read_notifs()

    def _read_notifs(self) -> None:
        for peer, messages in self._agent.get_new_notifs().items():  # progresses the worker
            peer = peer.decode() if isinstance(peer, bytes) else peer
            self._notifs.extend((peer, m) for m in messages)

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        if self._local_dlist is not None:
            self._agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
