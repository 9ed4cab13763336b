"""The engine role. One engine class plays three roles; the role is this enum.

The integer values cross process boundaries (the proto enum, the router, the
wire format of hand-offs): keep them identical everywhere.
"""

import enum


class EngineType(enum.Enum):
    """What an `LLMEngine` instance does in the cluster."""

    NORMAL = 0  # prefill and decode in one engine
    PROMPT = 1  # prefill only ("PE"): hands KV and the first token to a CE
    COMPLETION = 2  # decode only ("CE"): receives KV from a PE

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        """Whether step N+1's CPU work overlaps step N's device work by default.

        Off for PROMPT: a prefill step's host work is large and a PE must hand
        requests off as soon as possible; a one-beat delay adds hand-off latency.
        """
        return self in (EngineType.NORMAL, EngineType.COMPLETION)

    @property
    def short_name(self) -> str:
        return self.name
