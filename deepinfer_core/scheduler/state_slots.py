"""Per-sequence state slots (sliding-window or recurrent state beside the paged KV).

Models without such state get a pool of size 0 and every sequence keeps state_id -1.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def can_allocate(self) -> bool:
        return not self.enabled or bool(self._free)

    def allocate(self) -> int:
        if not self.enabled:
            return -1
        if not self._free:
            raise RuntimeError("out of state slots: call can_allocate() first")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot >= 0:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
