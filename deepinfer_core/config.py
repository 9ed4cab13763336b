"""The engine's configuration tree: frozen dataclasses, verified on construction.

`EngineArgs.create_engine_config()` builds it; every component receives the
part it needs. Bad combinations raise `ValueError` naming the fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from deepinfer_core.roles import EngineType, RoleProfile, role_profile

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

LOAD_FORMATS = ("auto", "dummy")


def parse_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """'auto' means bf16 on CUDA and fp32 on CPU (CPU half-precision GEMMs are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}") from None


@dataclass(frozen=True)
class ModelConfig:
    path: str
    """Directory holding config.json, safetensors weights and tokenizer files."""
    hf_config: dict[str, Any] = field(repr=False)
    """The parsed config.json."""
    dtype: torch.dtype
    """Parameter and activation dtype."""
    max_model_len: int
    """Longest sequence (prompt + output) the engine accepts."""
    seed: int = 0
    """Seed for weights of built-in models and for sampling without a per-request seed."""
    builtin: bool = False
    """True when `path` is the embedded tiny model (weights made from a fixed seed)."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; None means `path`."""
    load_format: str = "auto"
    """"auto": weights from the checkpoint's safetensors files; "dummy": random weights drawn on the
    device from `seed`, no weight file read (benchmarks at a real model's shapes)."""

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        limit = self.hf_config.get("max_position_embeddings")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if limit is not None and self.max_model_len > limit and not self.hf_config.get("rope_scaling"):
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else self.hf_config.get("model_type", "unknown")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per paged KV block."""
    num_gpu_blocks: Optional[int] = None
    """Fixed number of KV blocks; None means: measure with `profile_run`."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (weights + activations + KV)."""
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024
    """KV budget when running on CPU (no device memory to measure)."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks across requests by chain hash of their tokens."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")


@dataclass(frozen=True)
class ParallelConfig:
    engine_type: EngineType = EngineType.NORMAL
    data_parallel_size: int = 1
    """DP-attention ranks stepping in lockstep (NORMAL engines vote on the step kind)."""
    data_parallel_rank: int = 0
    context_parallel_size: int = 1
    expert_parallel_size: int = 1

    """Ranks the routed experts are sharded over; each is also a DP-attention rank, so it equals
    `data_parallel_size` when > 1 (one instance of that many ranks, `deepinfer_core.distributed`)."""
    moe_dispatch: str = "all_to_all"
    """How an expert-parallel MoE layer moves tokens (`distributed/dispatch.py`): "all_to_all" sends
    exactly the routed rows (counts first); "padded" sends fixed buffers sized by the role's token
    bound (`SchedulerConfig.max_step_tokens`): static shapes, for CUDA-graph capture."""

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "context_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank} outside [0, {self.data_parallel_size})")
        if self.moe_dispatch not in ("all_to_all", "padded"):
            raise ValueError(f"unknown moe_dispatch {self.moe_dispatch!r}; choose all_to_all or padded")
        if self.expert_parallel_size > 1 and self.expert_parallel_size != self.data_parallel_size:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} needs data_parallel_size equal to it "
                f"(every expert-parallel rank is a DP-attention rank), got {self.data_parallel_size}"
            )

    @property
    def role(self) -> RoleProfile:
        return role_profile(self.engine_type)


EPLB_POLICIES = ("hierarchical", "global")


@dataclass(frozen=True)
class EplbConfig:
    """The expert-parallel load balancer (SPEC §1 last row, §6; `deepinfer_core/eplb/`)."""

    enabled: bool = False
    """Rearrange experts by measured load (expert parallelism counts the load either way)."""
    num_redundant_experts: int = 0
    """Extra physical expert slots per MoE layer, for replicas of hot experts."""
    rearrange_interval: Optional[int] = None
    """Counted steps between rearrangements; None: the role's `eplb_interval`."""
    policy: Optional[str] = None
    """"hierarchical" or "global"; None: the role's `eplb_policy`."""
    ranks_per_node: int = 0
    """Hierarchical policy: ranks sharing a node (0: one node holds every rank)."""
    measure_interval: int = 100
    """Counted steps between measurements of the load imbalance (one small all-reduce each)."""

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.rearrange_interval is not None and self.rearrange_interval < 1:
            raise ValueError(f"rearrange_interval must be >= 1, got {self.rearrange_interval}")
        if self.policy is not None and self.policy not in EPLB_POLICIES:
            raise ValueError(f"unknown EPLB policy {self.policy!r}; choose one of {', '.join(EPLB_POLICIES)}")
        if self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node must be >= 0, got {self.ranks_per_node}")
        if self.measure_interval < 1:
            raise ValueError(f"measure_interval must be >= 1, got {self.measure_interval}")


@dataclass(frozen=True)
class SchedulerConfig:
    engine_type: EngineType
    max_model_len: int
    max_num_batched_tokens: int
    """Token budget of one step (prefill tokens + one per decode sequence)."""
    max_num_seqs: int = 256
    """Most sequences in one step."""
    chunked_prefill: bool = False
    """Split a long prompt across steps instead of refusing prompts over the budget."""
    stop_preempted_request: bool = False
    """On KV exhaustion, stop the preempted request (True) or recompute it later (False)."""
    prefill_kv_watermark: float = 0.95
    """NORMAL + DP: a rank wants to prefill only while KV usage is at or under this."""
    num_decode_tokens_per_seq: int = 1
    """1 + draft tokens (nextn) a decode step feeds per sequence."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked_prefill=False: a prompt of "
                "max_model_len tokens could never be scheduled. Enable chunked_prefill or raise "
                "max_num_batched_tokens."
            )
        if role_profile(self.engine_type).requires_stop_preempted_request and not self.stop_preempted_request:
            raise ValueError(
                f"{self.engine_type.name} engine cannot recompute preempted requests (it has no prefill channel); "
                "it must be started with stop_preempted_request=True (--stop-preempted-request)"
            )

    @property
    def prompt_limit(self) -> int:
        """Longest prompt this scheduler can admit."""
        if self.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        """nextn: draft tokens a decode step verifies per sequence (0: no speculative decoding)."""
        return self.num_decode_tokens_per_seq - 1

    @property
    def max_num_decoding_tokens(self) -> int:
        return self.max_num_seqs * self.num_decode_tokens_per_seq

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one forward of this role carries (SPEC §1's MoE / workspace token bound): the
        prefill budget where prefill steps run, `max_num_decoding_tokens` on a decode-only engine."""
        if role_profile(self.engine_type).peak_step == "decode":
            return self.max_num_decoding_tokens
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class PDConfig:
    """The prefill/decode hand-off's clocks: one source for the engines, the router and the head.

    Order matters: a PE waits at most `transfer_timeout_s` for its KV writes; a CE keeps the
    blocks of a lease that expired without a notice quarantined for `lease_grace_s`, which must
    outlast any write still landing (so grace > transfer); the router's prefill call may take
    `prefill_timeout_s` (queueing + prefill + transfer), within the lease."""

    transfer_timeout_s: float = 30.0
    """How long a PE waits for one request's KV writes before failing its hand-off."""
    lease_s: float = 130.0
    """A CE reservation's lease: longer than a prefill may take, so a slow PE does not lose it."""
    renewed_lease_s: float = 10.0
    """The lease the router reserves with and renews (a heartbeat every third of it, CE then PE)
    for as long as the prefill runs: a long prompt keeps its reservation, and one whose router or
    PE died unseen is let go within this plus the grace. `lease_s` is for reservations nobody renews."""
    lease_grace_s: float = 35.0
    """Quarantine of an expired or aborted lease's blocks (a PE may still be writing them)."""
    prefill_timeout_s: float = 120.0
    """The router's deadline for one Prefill call."""
    state_copy_interval: int = 128
    """A CE copies a sequence's state slot each time it crosses this many tokens."""
    local_prefill_tokens: int = 0
    """Conditional disaggregation: a prompt whose uncached part is at most this many tokens is
    prefilled on the CE itself when it has room, skipping the PE and the KV transfer (the router
    asks, the CE decides against its own prefix cache and step bound). 0: every prompt goes to a PE."""

    def __post_init__(self) -> None:
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        for name in ("transfer_timeout_s", "lease_s", "renewed_lease_s", "lease_grace_s", "prefill_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lease_grace_s <= self.transfer_timeout_s:
            raise ValueError(
                f"lease_grace_s ({self.lease_grace_s}) must exceed transfer_timeout_s ({self.transfer_timeout_s}): "
                "quarantined blocks could be reused while a prefill engine still writes them"
            )
        if self.prefill_timeout_s >= self.lease_s:
            raise ValueError(
                f"prefill_timeout_s ({self.prefill_timeout_s}) must be under lease_s ({self.lease_s}): "
                "a reservation would expire while its prefill may still succeed"
            )
        if self.state_copy_interval < 1:
            raise ValueError(f"state_copy_interval must be >= 1, got {self.state_copy_interval}")


KV_STORE_BACKENDS = ("POSIX", "FILE")


@dataclass(frozen=True)
class KVStoreConfig:
    """The KV cache store under the engine's prefix cache (`deepinfer_core/kvstore/`): L2, a host-memory
    pool per engine, and L3, entry files under `directory` (or objects in the bucket of `url`) shared
    by every engine pointed at it. Off (nothing changes) unless `directory` or `url` is set."""

    directory: Optional[str] = None
    """L3's directory (local disk, or a shared filesystem for a cluster-wide store); None: no store."""
    url: Optional[str] = None
    """L3 in an S3-compatible bucket instead of a directory: "s3://bucket[/prefix]", moved by NIXL's
    OBJ backend (`kvstore/object_tier.py`); credentials from the standard AWS environment."""
    endpoint: Optional[str] = None
    """`url`'s S3-compatible endpoint ("http://minio:9000"); None: AWS S3 (or `AWS_ENDPOINT_URL`)."""
    region: Optional[str] = None
    """`url`'s region; None: `AWS_REGION` / `AWS_DEFAULT_REGION`, else us-east-1."""
    l2_bytes: int = 256 * 1024 * 1024
    """This engine's host-memory pool: staging for every save and load, and the L2 tier."""
    l3_bytes: int = 16 * 1024 * 1024 * 1024
    """Most bytes of entry files in `directory`, all engines together; least recently used go first."""
    backend: str = "POSIX"
    """"POSIX": NIXL's POSIX storage backend moves entries between the pool and the files; "FILE":
    plain file reads and writes (the same frames and index)."""
    save_every_blocks: int = 0
    """CE: also save a running sequence's full blocks each time this many new ones have filled
    (0: only when it finishes)."""
    load_timeout_s: float = 5.0
    """PE: a load slower than this is dropped and its blocks recomputed."""
    join_wait_s: float = 0.02
    """PE: how long a prefill step waits for the loads it has just started, so that their sequences
    join this step rather than the next (a load of many blocks is far shorter than a prefill step)."""
    namespace: str = ""
    """Extra key of every entry: anything outside the model and its KV layout that changes KV (an
    adapter, a deployment's revision). Engines share entries only when this is equal too."""

    def __post_init__(self) -> None:
        if self.url is not None:
            if self.directory is not None:
                raise ValueError("a KV store is a directory or a bucket URL, not both")
            bucket_of(self.url)
            if self.endpoint is not None and not re.match(r"https?://[^/\s]+", self.endpoint):
                raise ValueError(f"KV store endpoint {self.endpoint!r}: give a URL, e.g. http://minio:9000")
        elif self.endpoint is not None or self.region is not None:
            raise ValueError("a KV store endpoint or region needs a bucket URL (s3://bucket[/prefix])")
        if self.backend not in KV_STORE_BACKENDS:
            raise ValueError(f"unknown KV store backend {self.backend!r}; choose one of {', '.join(KV_STORE_BACKENDS)}")
        for name in ("l2_bytes", "l3_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every_blocks < 0:
            raise ValueError(f"save_every_blocks must be >= 0, got {self.save_every_blocks}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be > 0, got {self.load_timeout_s}")
        if self.join_wait_s < 0:
            raise ValueError(f"join_wait_s must be >= 0, got {self.join_wait_s}")

    @property
    def enabled(self) -> bool:
        return self.directory is not None or self.url is not None

    @property
    def location(self) -> str:
        """Where L3 is, for logs and errors."""
        return self.url if self.url is not None else str(self.directory)


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def bucket_of(url: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/" or empty) of "s3://bucket[/prefix]"; ValueError otherwise."""
    if not url.startswith("s3://"):
        raise ValueError(f"KV store URL {url!r}: only s3://bucket[/prefix] is supported")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"KV store URL {url!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str
    """'cpu' or 'cuda[:N]'."""
    enforce_eager: bool = False
    pd: PDConfig = PDConfig()
    kv_store: KVStoreConfig = KVStoreConfig()
    eplb: EplbConfig = EplbConfig()

    @property
    def engine_type(self) -> EngineType:
        return self.parallel.engine_type

    @property
    def role(self) -> RoleProfile:
        return self.parallel.role
