"""User-facing engine arguments; `create_engine_config()` turns them into the config tree."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from deepinfer_core import envs
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.config import (
    CacheConfig,
    EngineConfig,
    EplbConfig,
    KVStoreConfig,
    ModelConfig,
    ParallelConfig,
    PDConfig,
    SchedulerConfig,
    parse_dtype,
)
from deepinfer_core.distributed.placement import check_expert_parallel
from deepinfer_core.roles import EngineType, role_profile


def default_block_size(hf_config: dict, device: str) -> int:
    """64 tokens for MLA models (a latent cache: DeepSeek-V2/V3) on CUDA, 16 otherwise.

    The sm_90 MLA decode kernel brings a block's latent rows by TMA in boxes that stay inside one page:
    half a 64-token block is 2 boxes from 64-token pages (one 3D box of its four column chunks, and
    the rope columns) and 16-20 from 16-token pages, and issuing them sits on the chain that refills a
    buffer. So at 128 heads (compute-bound) the op is faster from 64-token blocks, while at 16 and 32
    heads (memory-bound) the two sizes time alike (docs/benchmarks.md, "Figures formerly in code").
    FlashMLA serves from 64-token pages too. Smaller blocks share prefixes at a finer grain, and the
    CPU path gains nothing from larger ones."""
    if device.startswith("cuda") and hf_config.get("kv_lora_rank"):
        return 64
    return 16


@dataclass
class EngineArgs:
    model: Optional[str] = None
    """Hugging Face model directory; None selects the embedded tiny model."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; defaults to `model`."""
    engine_type: EngineType = EngineType.NORMAL
    dtype: str = "auto"
    load_format: str = "auto"
    """"auto": the checkpoint's safetensors; "dummy": random weights made on the device (config.json only)."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:N'."""
    seed: int = 0
    max_model_len: Optional[int] = None
    """Defaults to the model's max_position_embeddings."""
    block_size: Optional[int] = None
    """Tokens per KV block; None: `default_block_size` (64 for MLA models on CUDA, else 16)."""
    num_gpu_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    max_num_batched_tokens: Optional[int] = None
    """Defaults to max_model_len without chunked prefill, 2048 with it."""
    max_num_seqs: int = 256
    chunked_prefill: bool = False
    stop_preempted_request: bool = False
    enforce_eager: bool = False
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    moe_dispatch: str = "all_to_all"
    """Expert-parallel token movement: "all_to_all" or "padded" (`ParallelConfig.moe_dispatch`)."""
    pd: Optional[PDConfig] = None
    """The P/D hand-off's timeouts and lease; None: `PDConfig()`'s defaults."""
    kv_store: Optional[KVStoreConfig] = None
    """The KV cache store (L2 host pool, L3 files); None: no store."""
    num_speculative_tokens: Optional[int] = None
    """MTP draft tokens per decode step (nextn); None: DEEPINFER_USE_NEXTN_DECODE. Ignored by a
    role that does not decode (a PE)."""
    eplb: Optional[EplbConfig] = None
    """The expert-parallel load balancer; None: `EplbConfig()` (off, no redundant experts)."""

    def __post_init__(self) -> None:
        if isinstance(self.engine_type, int):
            self.engine_type = EngineType(self.engine_type)
        if self.tokenizer is None:
            self.tokenizer = self.model
        # The role provides defaults; an operator's explicit environment wins.
        role = role_profile(self.engine_type)
        os.environ.setdefault(
            "DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1" if role.default_zero_overhead_scheduling else "0"
        )
        envs.rearm("DEEPINFER_ZERO_OVERHEAD_SCHEDULING")
        os.environ.setdefault("DEEPINFER_USE_MULTIMODAL_POOL", "1" if role.multimodal_pool_default else "0")
        envs.rearm("DEEPINFER_USE_MULTIMODAL_POOL")

    @property
    def nextn(self) -> int:
        nextn = envs.DEEPINFER_USE_NEXTN_DECODE if self.num_speculative_tokens is None else self.num_speculative_tokens
        if nextn < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {nextn}")
        return nextn

    def resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} requested but CUDA is not available")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"unknown device {self.device!r}; use auto, cpu or cuda[:N]")
        return self.device

    def create_model_config(self, device: str) -> ModelConfig:
        from deepinfer_core.models.hf_config import load_hf_config

        path = self.model or TINY_MODEL_DIR
        hf_config = load_hf_config(path)
        max_len = self.max_model_len or int(hf_config.get("max_position_embeddings", 2048))
        return ModelConfig(
            path=path,
            hf_config=hf_config,
            dtype=parse_dtype(self.dtype, device),
            max_model_len=max_len,
            seed=self.seed,
            builtin=self.model is None,
            tokenizer=self.tokenizer,
            load_format=self.load_format,
        )

    def create_engine_config(self) -> EngineConfig:
        role = role_profile(self.engine_type)
        device = self.resolve_device()
        model = self.create_model_config(device)
        budget = self.max_num_batched_tokens or (2048 if self.chunked_prefill else max(model.max_model_len, 2048))
        scheduler = SchedulerConfig(
            engine_type=self.engine_type,
            max_model_len=model.max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            chunked_prefill=self.chunked_prefill,
            stop_preempted_request=self.stop_preempted_request,
            num_decode_tokens_per_seq=1 + (self.nextn if role.speculative_decoding else 0),
        )
        cache = CacheConfig(
            block_size=self.block_size or default_block_size(model.hf_config, device),
            num_gpu_blocks=self.num_gpu_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_bytes=self.cpu_kv_cache_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        parallel = ParallelConfig(
            engine_type=self.engine_type,
            data_parallel_size=self.data_parallel_size,
            data_parallel_rank=self.data_parallel_rank,
            context_parallel_size=self.context_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            moe_dispatch=self.moe_dispatch,
        )
        from deepinfer_core.models.hf_config import num_routed_experts

        eplb = self.eplb or EplbConfig()
        if self.expert_parallel_size > 1 or eplb.num_redundant_experts:  # fail before any rank starts
            check_expert_parallel(num_routed_experts(model.hf_config), self.expert_parallel_size,
                                  eplb.num_redundant_experts)  # fmt: skip
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            device=device,
            enforce_eager=self.enforce_eager or envs.DEEPINFER_ENFORCE_EAGER,
            pd=self.pd or PDConfig(),
            kv_store=self.kv_store or KVStoreConfig(),
            eplb=eplb,
        )
