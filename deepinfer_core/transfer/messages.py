"""What crosses between a CE and a PE: the CE's KV region, the KV target and the hand-off notice.

`KVRegion` is published once, when a CE registers (a PE prepares its descriptor list for it
then; it travels in the `KVRegion` proto of `WorkerInfo` / `ConnectPeerRequest`). The target
travels between services as the `KVTarget` proto (a CE's Reserve reply, a PE's Prefill request);
its JSON form (`to_bytes`) and the notice's are versioned JSON (agent metadata is base64), never
pickle: they cross process and host boundaries and may come from a different build.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

WIRE_VERSION = 1


def _dump(kind: str, obj) -> bytes:
    return json.dumps({"kind": kind, "v": WIRE_VERSION, **obj}).encode()


def _load(kind: str, data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {kind} message: {e}") from None
    if obj.pop("kind", None) != kind:
        raise ValueError(f"expected a {kind} message")
    version = obj.pop("v", None)
    if version != WIRE_VERSION:
        raise ValueError(f"{kind} wire version {version} is not supported (this build speaks {WIRE_VERSION})")
    return obj


@dataclass(frozen=True)
class KVRegion:
    """A CE's whole KV buffer `[num_layers, num_blocks_total, *block]`, as a PE addresses it."""

    base_addr: int
    """Address of the buffer."""
    num_blocks_total: int
    """Blocks per layer (the layer stride, in blocks)."""
    device_id: int
    mem_type: str
    """'DRAM' or 'VRAM'."""
    fingerprint: str = ""
    """The CE's KV layout fingerprint ("" when unknown: not checked)."""
    layout: str = ""
    """Human-readable layout, for error messages."""


@dataclass
class KVTarget:
    """Where a PE must write one request's KV: a CE's reserved blocks."""

    request_id: str
    engine_id: str
    """The CE's transfer-agent name."""
    agent_metadata: bytes = field(repr=False)
    """The CE agent's NIXL metadata (lets a PE connect to a CE it has not seen)."""
    base_addr: int
    """Address of the CE's KV buffer `[num_layers, num_blocks_total, *block]`."""
    num_blocks_total: int
    """Blocks per layer in the CE's buffer (the layer stride, in blocks)."""
    device_id: int
    mem_type: str
    """'DRAM' or 'VRAM'."""
    block_ids: list[int]
    """CE blocks for prompt + 1 tokens, in token order."""
    fingerprint: str
    """The CE's KV layout fingerprint; the PE refuses a target that differs from its own."""
    num_prompt_tokens: int
    expires_at: float = 0.0
    """Wall-clock time (the CE's) after which the reservation is void: a PE must not write later."""
    layout: str = ""
    """Human-readable layout, for error messages."""

    def to_bytes(self) -> bytes:
        obj = asdict(self)
        obj["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return _dump("kv_target", obj)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVTarget:
        obj = _load("kv_target", data)
        obj["agent_metadata"] = base64.b64decode(obj["agent_metadata"])
        return cls(**obj)


@dataclass
class HandoffNotice:
    """PE -> CE after the KV write completed (or failed): the CE may start decoding."""

    request_id: str
    ok: bool
    first_token: int = -1
    num_computed_tokens: int = 0
    """Prompt tokens whose KV is now in the CE's blocks."""
    first_logprob: Optional[float] = None
    first_top_logprobs: Optional[dict[int, float]] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0
    """Prompt tokens the PE did not compute (its prefix cache, the KV store): the request's cached tokens."""
    image_spans: Optional[list[tuple[int, int, int]]] = None
    """(offset, length, content hash) of the prompt's images: the CE keys the blocks it saves to the
    KV store with them, as the PE did."""
    last_hidden: Optional[str] = None
    """The target's last hidden state at the prompt's last position (`spec_decode.handoff`): a CE
    that drafts with the MTP layer starts from it."""

    def to_bytes(self) -> bytes:
        obj = asdict(self)
        if self.first_top_logprobs is not None:
            obj["first_top_logprobs"] = {str(k): v for k, v in self.first_top_logprobs.items()}
        for name in (
            "num_cached_tokens",
            "image_spans",
            "last_hidden",
        ):  # left out when unset: the notice reads as before
            if not obj[name]:
                del obj[name]
        return _dump("handoff", obj)

    @classmethod
    def from_bytes(cls, data: bytes) -> HandoffNotice:
        obj = _load("handoff", data)
        if obj.get("first_top_logprobs") is not None:
            obj["first_top_logprobs"] = {int(k): v for k, v in obj["first_top_logprobs"].items()}
        if obj.get("image_spans") is not None:
            obj["image_spans"] = [tuple(int(x) for x in span) for span in obj["image_spans"]]
        return cls(**obj)
