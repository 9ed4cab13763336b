"""`HeadConfig`: what `deepinfer serve` is told, and the one source of each setting.

The router's, the gateway's and the workers' configs are derived from it (`router_config()`,
`gateway_config()`, `pool_spec()`), so a setting they share — `max_n`, the request deadline,
the P/D hand-off's clocks, the context length — is given once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from services.common.limits import RequestLimits
from services.common.workers import POOL_COLOCATED, POOL_DECODE, POOL_PREFILL
from services.controller.controller import PoolSpec
from services.gateway.core import GatewayConfig
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
    colocated: bool = False
    """One NORMAL engine per replica (`decode` replicas) instead of P/D pools."""
    decode_ep: int = 1
    """Ranks of each decode (or colocated) engine instance: expert parallelism with DP attention."""
    prefill_ep: int = 1
    """Ranks of each prefill engine instance."""
    engine_args: EngineSettings = EngineSettings()
    """Every engine's settings (model, sizes, the P/D clocks `pd` that the router follows too)."""
    api_key: Optional[str] = None
    limits: RequestLimits = RequestLimits()
    """`max_n` and the request deadline, for the gateway and the router alike."""
    max_concurrent_requests: int = 512
    """Requests in flight at once, counted over every API process; more get 429."""
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
    log_level: str = "WARNING"

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
        return (POOL_COLOCATED,) if self.colocated else (POOL_PREFILL, POOL_DECODE)

    @property
    def targets(self) -> dict[int, int]:
        """Replicas per pool at start."""
        return (
            {POOL_COLOCATED: self.decode} if self.colocated else {POOL_PREFILL: self.prefill, POOL_DECODE: self.decode}
        )

    def max_model_len(self) -> int:
        """The engines' context length: the one given, else the model's."""
        if self.engine_args.max_model_len:
            return int(self.engine_args.max_model_len)
        from deepinfer_core.models.hf_config import load_hf_config

        return int(load_hf_config(self.model_path).get("max_position_embeddings", 2048))

    def router_config(self) -> RouterConfig:
        return RouterConfig(limits=self.limits, pd=self.engine_args.pd, pools=self.pools)

    def gateway_config(self) -> GatewayConfig:
        return GatewayConfig(
            model_name=self.model_name,
            max_model_len=self.max_model_len(),
            api_key=self.api_key,
            limits=self.limits,
            max_concurrent_requests=self.max_concurrent_requests,
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

        for flag, ep in (("--decode-ep", self.decode_ep), ("--prefill-ep", self.prefill_ep)):
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
            self.engine_args,
            self.model_name,
            "" if self.cluster_host == "auto" else self.cluster_host,
            self.torch_threads,
            self.gpus_per_worker,
            self.log_level,
            ep_sizes=self.ep_sizes,
        )
