"""Image embeddings parked for prefill engines to READ over NIXL (a vision encoder's side).

One buffer, registered with NIXL once at start, cut into equal slots (every image of a model
has the same embedding shape [tokens_per_image, hidden]). Parking an image takes a slot and
hands out a lease (`EmbeddingHandle`); the slot is free again when the reader's notice says it
has read it, when the lease is released, or when it expires — so a reader that dies, a request
that is aborted or a router that forgets cannot hold memory for longer than the lease. A lease
can be short and renewed (`renew`, by its owner's id) for as long as its request waits for a
reader: a router that dies stops renewing, and the slot comes back one short lease later. The
pool never grows: when every slot is leased, `park` raises `PoolFull` (the caller answers 429).
Not thread-safe: one thread (the encoder's) calls it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass

import torch

from deepinfer_core import envs
from deepinfer_core.errors import EngineError
from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle, lease_of_notice

EXPIRY_GRACE_S = 2.0
"""An expired lease's slot is reused only this long after `expires_at`: a reader refuses a handle
within `READ_MARGIN_S` of it, so a READ that started in time is over before the bytes change."""
READ_MARGIN_S = 1.0


class PoolFull(EngineError):
    """Every slot of the embedding pool is leased."""


@dataclass
class _Lease:
    slot: int
    expires_at: float
    owner: str = ""


class EmbeddingPool:
    def __init__(self, slot_shape: tuple[int, int], dtype: torch.dtype, capacity_bytes: int, lease_s: float = 30.0):
        from deepinfer_core.transfer.agent_settings import progress_thread_delay
        from deepinfer_core.transfer.nixl_variant import api  # lazy: only an encoder process parks embeddings

        nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config

        self.slot_shape = tuple(slot_shape)
        self.dtype = dtype
        self.slot_bytes = slot_shape[0] * slot_shape[1] * torch.empty(0, dtype=dtype).element_size()
        self.num_slots = max(1, capacity_bytes // self.slot_bytes)
        self.lease_s = lease_s
        self.buffer = torch.zeros(self.num_slots, *self.slot_shape, dtype=dtype)
        self.name = f"ve-{uuid.uuid4().hex[:8]}"
        # readers' notices are answered by the progress thread at once (a poll between batches would
        # delay the lease's release by up to a batch); paused between rounds like the KV agents'
        with progress_thread_delay(envs.DEEPINFER_NIXL_PROGRESS_DELAY_US):
            self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        self._reg = self._agent.register_memory(self.buffer)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._leases: dict[int, _Lease] = {}
        self._owned: dict[str, set[int]] = {}
        """owner (the request that asked) -> its live leases: what `renew` extends."""
        self._ids = itertools.count(1)
        self.renewals = 0
        """Leases extended by `renew` (one per lease and renewal)."""

    @property
    def leased(self) -> int:
        """Slots held by live leases."""
        return len(self._leases)

    def park(self, embeds: torch.Tensor, content_hash: int, owner: str = "", lease_s: float = 0.0) -> EmbeddingHandle:
        """Copy one image's embeddings [P, H] into a free slot; a lease on it for `lease_s` (0: the
        pool's own), renewable under `owner` (empty: not renewable)."""
        self.reap()
        if not self._free:
            raise PoolFull(f"the embedding pool's {self.num_slots} slots are all leased; retry later")
        if tuple(embeds.shape) != self.slot_shape:
            raise ValueError(f"embeddings of shape {tuple(embeds.shape)}; the pool holds {self.slot_shape}")
        slot = self._free.pop()
        self.buffer[slot].copy_(embeds)
        lease_id = next(self._ids)
        expires_at = time.time() + (lease_s or self.lease_s)
        self._leases[lease_id] = _Lease(slot, expires_at, owner)
        if owner:
            self._owned.setdefault(owner, set()).add(lease_id)
        return EmbeddingHandle(
            agent_name=self.name,
            agent_metadata=self.metadata,
            addr=self.buffer[slot].data_ptr(),
            num_bytes=self.slot_bytes,
            shape=self.slot_shape,
            dtype=str(self.dtype).removeprefix("torch."),
            content_hash=content_hash,
            lease_id=lease_id,
            expires_at=expires_at,
        )

    def release(self, lease_id: int) -> bool:
        """Free a lease's slot; False when it was already free."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._free.append(lease.slot)
        owned = self._owned.get(lease.owner)
        if owned is not None:
            owned.discard(lease_id)
            if not owned:
                del self._owned[lease.owner]
        return True

    def renew(self, owner: str, lease_s: float) -> float:
        """Extend `owner`'s live leases to `lease_s` from now (never shortened); their end (wall
        clock), or 0.0 when it holds none: read, released or expired (an expired lease is never
        brought back: its reader has been told it is void)."""
        now = time.time()
        live = [self._leases[i] for i in self._owned.get(owner, ()) if self._leases[i].expires_at > now]
        for lease in live:
            lease.expires_at = max(lease.expires_at, now + lease_s)
        self.renewals += len(live)
        return min((lease.expires_at for lease in live), default=0.0)

    def reap(self) -> int:
        """Free the leases readers have read (their notices) and those past their time; how many."""
        freed = 0
        for messages in self._agent.get_new_notifs().values():
            for message in messages:
                lease = lease_of_notice(message)
                freed += lease is not None and self.release(lease)
        now = time.time() - EXPIRY_GRACE_S
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            freed += self.release(lease_id)
        return freed

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
