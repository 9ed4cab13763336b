"""`HeadConfig`: what `deepinfer serve` is told, and the one source of each setting.

The router's, the gateway's and the workers' configs are derived from it (`router_config()`,
`gateway_config()`, `pool_spec()`), so a setting they share — `max_n`, the request deadline,
the P/D hand-off's clocks, the context length — is given once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from deepinfer_core.multimodal.encoder_config import EncoderConfig
from services.common.auth import new_token
from services.common.limits import DEFAULT_MIGRATION_LIMIT, RequestLimits
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_ENCODER, POOL_NAMES, POOL_PREFILL
from services.controller.controller import PoolSpec
from services.gateway.core import GatewayConfig
from services.gateway.media import MediaLimits, VisionInfo
from services.gateway.tls import TLSConfig
from services.router.config import RouterConfig
from services.workers.spec import EngineSettings


@dataclass
class HeadConfig:
    served_model_name: Optional[str] = None
    """The model id clients use; None = the model directory's name."""
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    prefill: int = 1
    decode: int = 1
    encoder: int = 0
    """Vision encoders (VE): images are encoded there, embeddings read by the PEs over NIXL; 0 = the
    engines encode in process."""
    colocated: bool = False
    """One NORMAL engine per replica (`decode` replicas) instead of P/D pools."""
    decode_ep: int = 1
    """Ranks of each decode (or colocated) engine instance: expert parallelism with DP attention."""
    prefill_ep: int = 1
    """Ranks of each prefill engine instance."""
    engine_args: EngineSettings = EngineSettings()
    """Every engine's settings (model, sizes, the P/D clocks `pd` that the router follows too)."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Any of them opens /v1/* and the gRPC API (`Authorization: Bearer <key>`); none: open."""
    tls: TLSConfig = TLSConfig()
    """The gateway's certificate (HTTPS and gRPC over TLS) and the CAs of client certificates."""
    cluster_token: str = field(default_factory=new_token, repr=False)
    """The internal services' credential (`services/common/auth.py`): made per cluster unless given."""
    internal_reflection: bool = False
    """The router's and the workers' gRPC servers serve reflection (the gateway's always does)."""
    limits: RequestLimits = RequestLimits()
    """`max_n` and the request deadline, for the gateway and the router alike."""
    max_concurrent_requests: int = 512
    """Requests in flight at once, counted over every API process; more get 429."""
    max_concurrent_sequences: int = 4096
    """Sequences (prompts x n) in flight at once, over every API process; more get 429."""
    max_concurrent_prompt_tokens: int = 4 * 1024 * 1024
    """Prompt tokens in flight at once, over every API process; more get 429."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest HTTP body and gRPC message the gateway reads."""
    grpc_server: str = "h2"
    """The gateway's and the workers' gRPC servers: "h2" (their own HTTP/2, the fast one) or "grpcio"
    (`grpc.aio`)."""
    api_workers: int = 1
    """API processes serving the same HTTP and gRPC ports (the head and `api_workers` - 1 more), each
    with a gateway and a router of its own: one event loop is then not the limit."""
    torch_threads: int = 1
    gpus_per_worker: float = 0.0
    num_cpus: Optional[int] = None
    """CPUs Ray may schedule on this node (workers take none; set it to bound other Ray work)."""
    ray_address: Optional[str] = None
    """Join an existing Ray cluster instead of starting one."""
    autoscale: bool = False
    """The controller sizes the pools from their load (`planner.py`); bounds from `pools_config`."""
    pools_config: Optional[str] = None
    """The pools file (`pools_config.py`): each pool's Ray resource, GPUs per engine, policy bounds."""
    cluster_host: str = "127.0.0.1"
    """Where the router and the workers serve each other; "auto" = this node's IP."""
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    """Times a request may move to a healthy prefill/decode pair when its decode engine dies mid-stream."""
    stream_interval: int = 1
    """Decode workers send a request's new tokens every this many tokens (its first and its end at
    once): fewer, larger stream chunks, less CPU per token on every hop, more time between chunks."""
    log_level: str = "WARNING"
    encoder_config: EncoderConfig = EncoderConfig()
    """Each vision encoder's batching, pool, leases and cache."""
    media: MediaLimits = MediaLimits()
    """What a request's images may be (count, size, where file:// URLs may point, http fetching)."""

    @property
    def model_path(self) -> str:
        from deepinfer_core.builtin import TINY_MODEL_DIR

        return self.engine_args.model or TINY_MODEL_DIR

    @property
    def model_name(self) -> str:
        from deepinfer_core.builtin import TINY_MODEL_NAME

        if self.served_model_name:
            return self.served_model_name
        model = self.engine_args.model
        return os.path.basename(os.path.normpath(model)) if model else TINY_MODEL_NAME

    @property
    def pools(self) -> tuple[int, ...]:
        """The pools this cluster serves from (each needs a ready worker before it is ready)."""
        pools = (POOL_COLOCATED,) if self.colocated else (POOL_PREFILL, POOL_DECODE)
        return pools + ((POOL_ENCODER,) if self.encoder else ())

    @property
    def targets(self) -> dict[int, int]:
        """Replicas per pool at start."""
        targets = (
            {POOL_COLOCATED: self.decode} if self.colocated else {POOL_PREFILL: self.prefill, POOL_DECODE: self.decode}
        )
        return {**targets, POOL_ENCODER: self.encoder} if self.encoder else targets

    def max_model_len(self) -> int:
        """The engines' context length: the one given, else the model's."""
        if self.engine_args.max_model_len:
            return int(self.engine_args.max_model_len)
        from deepinfer_core.models.hf_config import load_hf_config

        return int(load_hf_config(self.model_path).get("max_position_embeddings", 2048))

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            limits=self.limits, pd=self.engine_args.pd, pools=self.pools, migration_limit=self.migration_limit
        )

    def gateway_config(self) -> GatewayConfig:
        return GatewayConfig(
            model_name=self.model_name,
            max_model_len=self.max_model_len(),
            api_keys=self.api_keys,
            limits=self.limits,
            max_concurrent_requests=self.max_concurrent_requests,
            max_concurrent_sequences=self.max_concurrent_sequences,
            max_concurrent_prompt_tokens=self.max_concurrent_prompt_tokens,
            max_request_bytes=self.max_request_bytes,
            grpc_server=self.grpc_server,
            media=self.media,
            vision=VisionInfo.from_model(self.model_path),
        )

    @property
    def ep_sizes(self) -> dict[int, int]:
        """Ranks per engine instance of each pool (pools of single-process engines left out)."""
        decode_pool = POOL_COLOCATED if self.colocated else POOL_DECODE
        sizes = {decode_pool: self.decode_ep, POOL_PREFILL: self.prefill_ep}
        return {pool: n for pool, n in sizes.items() if n > 1}

    def check_expert_parallel(self) -> None:
        """ValueError, before anything starts, when the model cannot be split over the EP sizes."""
        from deepinfer_core.distributed.placement import check_expert_parallel
        from deepinfer_core.models.hf_config import load_hf_config, num_routed_experts

        sizes = [("--decode-ep", self.decode_ep), ("--prefill-ep", self.prefill_ep)]
        if self.pools_config:  # the file's sizes win over the flags': they are checked too
            from services.controller.pools_config import load_pools_config

            file_sizes = load_pools_config(self.pools_config).ep_sizes
            sizes += [
                (f"{self.pools_config}: pool {POOL_NAMES[p]} expertParallelSize", n) for p, n in file_sizes.items()
            ]
        for flag, ep in sizes:
            if ep < 1:
                raise ValueError(f"{flag} must be at least 1")
            if ep > 1:
                redundant = self.engine_args.eplb.num_redundant_experts if self.engine_args.eplb else 0
                try:
                    check_expert_parallel(num_routed_experts(load_hf_config(self.model_path)), ep, redundant)
                except ValueError as e:
                    raise ValueError(f"{flag} {ep}: {e}") from None

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(
            engine_args=self.engine_args,
            model_name=self.model_name,
            host="" if self.cluster_host == "auto" else self.cluster_host,
            torch_threads=self.torch_threads,
            gpus_per_worker=self.gpus_per_worker,
            log_level=self.log_level,
            encoder=self.encoder_config,
            cluster_token=self.cluster_token,
            reflection=self.internal_reflection,
            ep_sizes=self.ep_sizes,
            stream_interval=self.stream_interval,
            grpc_server=self.grpc_server,
        )
