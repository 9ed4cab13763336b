"""Reads image embeddings from vision encoders over NIXL (a prefill engine's side).

The receive buffer is registered with NIXL once, at the first read, and its slots are reused:
one registration per image would cost more than the transfer (Dynamo's lesson). A READ pulls
one image's embeddings from the encoder's pool into a slot and carries the lease's notice, so
the encoder frees the lease as soon as the data has left it; the embeddings are then copied
out of the slot (the engine keeps them until the prefill ends) and the slot is free again.
"""

from __future__ import annotations

import time
import uuid

import torch

from deepinfer_core import envs
from deepinfer_core.errors import TransferError
from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from deepinfer_core.multimodal.embedding_pool import READ_MARGIN_S


class EmbeddingReader:
    def __init__(self, num_slots: int = 8, device: str = "cpu"):
        from deepinfer_core.transfer.agent_settings import progress_thread_delay
        from deepinfer_core.transfer.nixl_variant import api  # lazy: only engines that read embeddings

        nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config

        self.name = f"mm-{uuid.uuid4().hex[:8]}"
        self.num_slots = num_slots
        self.device = device
        with progress_thread_delay(envs.DEEPINFER_NIXL_PROGRESS_DELAY_US):
            self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._peers: set[str] = set()
        self._buffer: torch.Tensor | None = None  # [num_slots, slot_bytes] uint8, registered once
        self._reg = None
        self.bytes_read = 0
        self.seconds = 0.0

    @property
    def registered_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _slots(self, num_bytes: int) -> torch.Tensor:
        """The receive buffer, made and registered at the first read (every image of a model has
        the same size; a larger one replaces it once)."""
        if self._buffer is None or self._buffer.shape[1] < num_bytes:
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
            self._buffer = torch.zeros(self.num_slots, num_bytes, dtype=torch.uint8)
            self._reg = self._agent.register_memory(self._buffer)
        return self._buffer

    def _connect(self, h: EmbeddingHandle) -> None:
        if h.agent_name not in self._peers:
            added = self._agent.add_remote_agent(h.agent_metadata)
            added = added.decode() if isinstance(added, bytes) else added
            if added != h.agent_name:
                raise TransferError(f"encoder metadata names agent {added!r}, expected {h.agent_name!r}")
            self._peers.add(h.agent_name)

    def read(self, handles: list[EmbeddingHandle], timeout_s: float = 10.0) -> list[torch.Tensor]:
        """The embeddings of each handle (copies the caller owns), read in groups of `num_slots`.

        Raises:
            TransferError: a lease that has expired (or is about to), an encoder that is gone, a READ
                that failed or ran past `timeout_s`.
        """
        out: list[torch.Tensor] = []
        for start in range(0, len(handles), self.num_slots):
            out += self._read_group(handles[start : start + self.num_slots], timeout_s)
        return out

    def _read_group(self, handles: list[EmbeddingHandle], timeout_s: float) -> list[torch.Tensor]:
        started = time.monotonic()
        slots = self._slots(max(h.num_bytes for h in handles))
        xfers = []
        try:
            for i, h in enumerate(handles):
                if time.time() > h.expires_at - READ_MARGIN_S:
                    raise TransferError(f"the embeddings' lease {h.lease_id} at {h.agent_name} has expired")
                self._connect(h)
                local = self._agent.get_xfer_descs([(slots[i].data_ptr(), h.num_bytes, 0)], "DRAM")
                remote = self._agent.get_xfer_descs([(h.addr, h.num_bytes, h.device_id)], h.mem_type)
                xfer = self._agent.initialize_xfer("READ", local, remote, h.agent_name, h.done_notice())
                xfers.append(xfer)
                if self._agent.transfer(xfer) == "ERR":
                    raise TransferError(f"posting the embeddings READ from {h.agent_name} failed")
            self._wait(xfers, started + timeout_s)
        except TransferError:
            raise
        except Exception as e:  # nixl raises its own errors for a vanished peer
            raise TransferError(f"reading image embeddings failed: {type(e).__name__}: {e}") from e
        finally:
            for xfer in xfers:
                self._agent.release_xfer_handle(xfer)
        out = [self._unpack(slots[i], h) for i, h in enumerate(handles)]
        self.bytes_read += sum(h.num_bytes for h in handles)
        self.seconds += time.monotonic() - started
        return out

    def _wait(self, xfers: list, deadline: float) -> None:
        pending = list(xfers)
        while pending:
            states = [self._agent.check_xfer_state(x) for x in pending]
            if "ERR" in states:
                raise TransferError("an embeddings READ failed")
            pending = [x for x, s in zip(pending, states) if s != "DONE"]
            if pending and time.monotonic() > deadline:
                raise TransferError("an embeddings READ did not complete in time")
            if pending:
                time.sleep(0)

    def _unpack(self, slot: torch.Tensor, h: EmbeddingHandle) -> torch.Tensor:
        dtype = getattr(torch, h.dtype)
        return slot[: h.num_bytes].view(dtype).reshape(h.shape).clone().to(self.device)

    def close(self) -> None:
        for peer in self._peers:
            self._agent.remove_remote_agent(peer)
        self._peers.clear()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
