"""Who a worker is (`WorkerInfo`) and how loaded it is (`WorkerLoad`): the registry's vocabulary.

Field for field the proto messages `deepinfer.v1.WorkerInfo` / `WorkerLoad` (see
`deepinfer_proto/common.proto` for the meaning of each); `messages.py` converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deepinfer_core.engine.load import EngineLoad
from deepinfer_core.transfer.messages import KVRegion

# proto enum values, mirrored so that cores need no generated code
POOL_ENCODER, POOL_PREFILL, POOL_DECODE, POOL_COLOCATED = 1, 2, 3, 4
POOL_NAMES = {POOL_ENCODER: "encoder", POOL_PREFILL: "prefill", POOL_DECODE: "decode", POOL_COLOCATED: "colocated"}


@dataclass
class WorkerInfo:
    worker_id: str
    pool: int
    """One of the POOL_* values."""
    engine_type: int
    """`EngineType.value`."""
    address: str
    """host:port of the worker's gRPC server."""
    metrics_address: str = ""
    agent_name: str = ""
    agent_metadata: bytes = b""
    model: str = ""
    max_model_len: int = 0
    block_size: int = 0
    num_blocks: int = 0
    max_num_seqs: int = 0
    pid: int = 0
    kv_region: Optional[KVRegion] = None
    """CE: its KV buffer, so PEs prepare their transfer descriptors for it at registration
    (None from an older worker: the first hand-off prepares them)."""

    @property
    def pool_name(self) -> str:
        return POOL_NAMES.get(self.pool, "unknown")


@dataclass
class WorkerLoad(EngineLoad):
    """The engine's load (`EngineLoad`) and what the worker around it adds."""

    worker_id: str = ""
    draining: bool = False
    open_streams: int = 0
    encoder_images: int = 0
    """VE: images encoded (the vision tower ran on them)."""
    encoder_cache_hits: int = 0
    """VE: images served from the encoder cache, not encoded again."""
    encoder_queue_images: int = 0
    """VE: images waiting for a batch now."""
    embedding_leases: int = 0
    """VE: embedding pool slots leased now (0 once every reader has read or every lease expired)."""
    embedding_lease_renewals: int = 0
    """VE: leases extended by a router's heartbeat (a request waiting for a PE to read them)."""
