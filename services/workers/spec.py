"""What a worker is started with: its engine's settings and where it serves and registers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from deepinfer_core.config import EplbConfig, KVStoreConfig, PDConfig
from deepinfer_core.multimodal.encoder_config import EncoderConfig
from deepinfer_core.roles import EngineType, role_profile


@dataclass(frozen=True)
class EngineSettings:
    """The `EngineArgs` fields the services choose for every engine they start; the role
    (engine type, what it demands) is added per pool. None leaves `EngineArgs`' default.

    Plain values, not an `EngineArgs`: building one applies role defaults to the process
    environment, which the head (whose environment Ray's workers inherit) must not do.
    """

    model: Optional[str] = None
    """Hugging Face model directory; None = the embedded tiny model."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; None = the model's."""
    dtype: Optional[str] = None
    device: Optional[str] = None
    max_model_len: Optional[int] = None
    block_size: Optional[int] = None
    num_gpu_blocks: Optional[int] = None
    """KV blocks per engine; None = measured."""
    max_num_seqs: Optional[int] = None
    num_speculative_tokens: Optional[int] = None
    """MTP draft tokens per decode step on CE and NORMAL engines; None = DEEPINFER_USE_NEXTN_DECODE."""
    pd: PDConfig = PDConfig()
    """The hand-off's clocks: the engines' and the router's (`RouterConfig.pd`) are this one."""
    kv_store: KVStoreConfig = KVStoreConfig()
    """The KV cache store under every PE and CE (off unless it names a directory)."""
    eplb: Optional[EplbConfig] = None
    """The expert-parallel load balancer of every instance rank; None: off, no redundant experts."""
    moe_dispatch: Optional[str] = None
    """How instance ranks move MoE tokens ("all_to_all" or "padded"); None: `EngineArgs`' default."""

    def to_engine_args(self, engine_type: EngineType, rank: Optional[InstanceRank] = None):
        """The `EngineArgs` of an engine of `engine_type` (built in the worker's own process);
        `rank`: its place in an expert-parallel instance."""
        from deepinfer_core.engine_args import EngineArgs  # torch: only where an engine runs

        chosen = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if role_profile(engine_type).requires_stop_preempted_request:
            chosen["stop_preempted_request"] = True
        if rank is not None:
            chosen.update(expert_parallel_size=rank.size, data_parallel_size=rank.size, data_parallel_rank=rank.rank)
        return EngineArgs(engine_type=engine_type, **chosen)


@dataclass(frozen=True)
class InstanceRank:
    """A worker's place in an engine instance of several ranks (expert parallelism: one worker
    per rank, each a decode or prefill target of its own)."""

    rank: int
    size: int
    address: str
    """"host:port" of the instance's rendezvous (rank 0 hosts it)."""
    join_timeout_s: float = 120.0
    """A rank missing after this long fails the start, naming it."""
    collective_timeout_s: float = 60.0
    """A collective stuck this long fails the instance."""


@dataclass
class WorkerSpec:
    worker_id: str
    pool: int
    """POOL_PREFILL, POOL_DECODE or POOL_COLOCATED."""
    engine_args: EngineSettings = field(default_factory=EngineSettings)
    model_name: str = ""
    """The model id clients use, reported at registration."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port; 0 = any free port."""
    router_address: str = ""
    """Register here once serving ("" = don't)."""
    cluster_token: str = field(default="", repr=False)
    """The cluster credential: the worker's server refuses calls without it and its registration
    carries it ("" = an open server, as a test may start one)."""
    reflection: bool = False
    """Serve gRPC reflection (off: an internal port need not describe itself)."""
    torch_threads: int = 0
    """torch intra-op threads for the engine; 0 = torch's default."""
    metrics: bool = True
    """Serve /metrics on a free port."""
    log_level: str = "WARNING"
    """Logging of the worker's process, when it is a Ray actor of its own."""
    encoder: EncoderConfig = EncoderConfig()
    """A vision encoder's batching, pool, lease and cache (the encoder pool only)."""
    instance: Optional[InstanceRank] = None
    """Set on a rank of an expert-parallel instance; None: a single-process engine."""
    stream_interval: int = 1
    """A streaming worker (CE, NORMAL) sends a request's delta every this many tokens (the first
    and the last at once): `OutputStreams.stream_interval`."""
    grpc_server: str = "h2"
    """The worker's gRPC server (`grpc_util.GRPC_SERVERS`): its own HTTP/2, or `grpc.aio`."""
