"""L2: one engine's host-memory pool of framed KV blocks, with an LRU index.

The pool is one `uint8` tensor `[num_slots, slot_bytes]` (pinned next to a GPU), registered once
with the storage agent, so every file transfer goes straight from or into a slot. A slot is either
free, or holds the entry of one key (the L2 tier, LRU), or is staging for a save or load without a
key yet. A slot in use by a save or load in flight is pinned and never evicted or reused: pins are
counted, and every path that takes one gives it back.

Only the engine's thread touches the index and the pins; the I/O thread reads and writes the bytes
of slots it was handed pinned.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from deepinfer_core.kvstore.frame import HEADER_BYTES


class HostPool:
    def __init__(self, capacity_bytes: int, payload_bytes: int, pin_memory: bool = False):
        self.slot_bytes = -(-(HEADER_BYTES + payload_bytes) // HEADER_BYTES) * HEADER_BYTES
        self.payload_bytes = payload_bytes
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"KV store l2_bytes={capacity_bytes} holds no block of {self.slot_bytes} bytes; raise it")
        self.buffer = torch.zeros((self.num_slots, self.slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._key_of: dict[int, bytes] = {}
        self._pins = [0] * self.num_slots
        self.evictions = 0

    # ---- views ------------------------------------------------------------------------
    def frame(self, slot: int) -> memoryview:
        """The slot's bytes (header + payload) as a writable buffer."""
        return memoryview(self.buffer[slot].numpy()).cast("B")[: HEADER_BYTES + self.payload_bytes]

    @property
    def payload_rows(self) -> torch.Tensor:
        """`[num_slots, payload_bytes]`: every slot's payload, a strided view of the pool."""
        return self.buffer[:, HEADER_BYTES : HEADER_BYTES + self.payload_bytes]

    @property
    def frame_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    # ---- index ------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def count_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, the pool holds."""
        n = 0
        while n < len(keys) and keys[n] in self._entries:
            n += 1
        return n

    def take(self, key: bytes) -> int:
        """The slot of a held `key`, pinned and marked most recently used."""
        slot = self._entries[key]
        self._entries.move_to_end(key)
        self._pins[slot] += 1
        return slot

    def stage(self, n: int) -> list[int]:
        """Up to `n` pinned slots without a key (free ones first, then the least recently used
        unpinned entries, evicted)."""
        slots = []
        while len(slots) < n and self._free:
            slots.append(self._free.pop())
        if len(slots) < n:
            unpinned = (k for k, s in self._entries.items() if self._pins[s] == 0)
            for key in list(itertools.islice(unpinned, n - len(slots))):
                slots.append(self._forget(key))
                self.evictions += 1
        for slot in slots:
            self._pins[slot] += 1
        return slots

    def publish(self, key: bytes, slot: int) -> bool:
        """`slot` (staged) now holds `key`'s entry; False (nothing changed) if the key is held already."""
        if key in self._entries or slot in self._key_of:
            return False
        self._entries[key] = slot
        self._key_of[slot] = key
        return True

    def unpin(self, slots: list[int]) -> None:
        """Give back pins; a slot left with neither pin nor key is free again."""
        for slot in slots:
            if self._pins[slot] <= 0:
                raise RuntimeError(f"host pool slot {slot} unpinned more often than pinned")
            self._pins[slot] -= 1
            if self._pins[slot] == 0 and slot not in self._key_of:
                self._free.append(slot)

    def drop(self, key: bytes) -> None:
        """Forget `key`'s entry (its slot frees once unpinned)."""
        if key in self._entries:
            slot = self._forget(key)
            if self._pins[slot] == 0:
                self._free.append(slot)

    def _forget(self, key: bytes) -> int:
        slot = self._entries.pop(key)
        del self._key_of[slot]
        return slot

    # ---- gauges -----------------------------------------------------------------------
    @property
    def num_pins(self) -> int:
        return sum(self._pins)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes
