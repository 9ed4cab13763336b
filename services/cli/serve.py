"""`deepinfer serve`: a local disaggregated cluster (Ray) behind the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio

from services.cli import kv_store_args, security_args
from services.common.limits import DEFAULT_MIGRATION_LIMIT, RequestLimits

DEFAULT_LOCAL_PREFILL_TOKENS = 64
"""Short enough that one decode engine's prefill step of it costs about a decode step's time on a
GPU (and a few on a CPU), so the decode streams beside it barely notice; longer prompts, and every
prompt that is mostly cached elsewhere, are the prefill pool's."""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model: gateway (HTTP + gRPC), router and P/D workers on Ray")
    _add_pool_flags(p)
    _add_engine_flags(p)
    _add_admission_flags(p)
    _add_cluster_flags(p)
    p.set_defaults(func=run)


def _add_pool_flags(p) -> None:
    """The model, the ports and the pools (sizes, expert-parallel ranks)."""
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded tiny model)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC servers (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port, OpenAI API (default: 8000; 0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (default: 50051; 0 = any free port)")
    p.add_argument("--prefill", type=int, default=1, help="prefill engines (default: 1)")
    p.add_argument("--decode", type=int, default=1, help="decode engines, or NORMAL engines with --colocated")
    p.add_argument("--colocated", action="store_true", help="one NORMAL engine per replica instead of P/D pools")
    p.add_argument(
        "--encoder",
        type=int,
        default=None,
        help="vision encoders (images are encoded there; prefill engines read the embeddings over NIXL); "
        "default: 1 for a model with a vision tower, served P/D; 0 = engines encode in process",
    )
    p.add_argument(
        "--decode-ep",
        type=int,
        default=1,
        help="ranks per decode (or colocated) engine instance: experts sharded over them, attention data-parallel, "
        "each rank a decode target (default: 1)",
    )
    p.add_argument("--prefill-ep", type=int, default=1, help="ranks per prefill engine instance (default: 1)")
    p.add_argument("--enable-eplb", action="store_true", help="instances rearrange experts by measured load")
    p.add_argument(
        "--redundant-experts", type=int, default=0, help="extra expert slots per MoE layer, for hot experts' replicas"
    )
    p.add_argument(
        "--eplb-interval", type=int, default=None, help="counted steps between rearrangements (default: the role's)"
    )
    p.add_argument(
        "--moe-dispatch",
        choices=("all_to_all", "padded"),
        default=None,
        help="how instance ranks move MoE tokens: exact counts (all_to_all, default) or fixed buffers sized by "
        "the role's step token bound (padded: static shapes, for CUDA graphs)",
    )


def _add_engine_flags(p) -> None:
    """Every engine's sizes and numerics."""
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: 64 for MLA models on CUDA, else 16)"
    )
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per engine (default: measured)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="MTP draft tokens per decode step (DeepSeek-V3 MTP layer; decode and colocated engines); "
        "default: DEEPINFER_USE_NEXTN_DECODE, else 0",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")


def _add_admission_flags(p) -> None:
    """What the front door admits and how long a request may take."""
    p.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="largest n a request may ask for")
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        help="more in flight, over all API processes together, get HTTP 429 / RESOURCE_EXHAUSTED (default: 512)",
    )
    p.add_argument(
        "--max-concurrent-sequences",
        type=int,
        default=4096,
        help="sequences (prompts x n) in flight over all requests; more get 429 with Retry-After, one request "
        "asking more than this alone gets 400 (default: 4096)",
    )
    p.add_argument(
        "--max-concurrent-prompt-tokens",
        type=int,
        default=4 * 1024 * 1024,
        help="prompt tokens in flight over all requests; more get 429 with Retry-After (default: 4194304)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest HTTP body (413 past it) and gRPC message (RESOURCE_EXHAUSTED) (default: 8388608)",
    )
    p.add_argument(
        "--grpc-server",
        choices=("h2", "grpcio"),
        default="h2",
        help="the gateway's and the workers' gRPC servers: h2, their own HTTP/2 (a few µs of CPU a streamed "
        "message), or grpcio, grpc's asyncio server (~40-65 µs a message) (default: h2)",
    )
    p.add_argument(
        "--api-workers",
        type=int,
        default=1,
        help="API processes serving the same HTTP and gRPC ports, each with its own gateway and router "
        "(Linux SO_REUSEPORT: the kernel spreads connections); process 0 is the head, which restarts "
        "any other that dies; /metrics of any of them counts all (default: 1)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=RequestLimits.request_timeout_s,
        help="end-to-end deadline per request (s)",
    )


def _add_cluster_flags(p) -> None:
    """Ray, the controller, migration, conditional disaggregation, the KV store, images and security."""
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine on CPU")
    p.add_argument("--gpus-per-worker", type=float, default=None, help="default: 1 when CUDA is present, else 0")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray node")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="the controller sizes the prefill and decode pools from their load (bounds: --pools-config)",
    )
    p.add_argument(
        "--pools-config",
        default=None,
        help="pools file (JSON; the Helm chart writes it): each pool's Ray resource, GPUs per engine, autoscaling bounds",
    )
    p.add_argument(
        "--cluster-host",
        default="127.0.0.1",
        help="address the router and the workers serve each other on; 'auto' = this node's IP (several machines)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=DEFAULT_MIGRATION_LIMIT,
        help="times a request may move to a healthy prefill/decode pair when its decode engine dies mid-stream "
        "(0 = end such streams with an error; default: %(default)s)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="decode workers send a request's new tokens every this many tokens (its first and last at once): "
        "fewer, larger chunks and less CPU per token through router and gateway, at more latency between "
        "chunks (default: %(default)s)",
    )
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        help="conditional disaggregation: a prompt whose uncached part is at most this many tokens is prefilled "
        f"on a decode engine with room, skipping the prefill pool and the KV transfer (0 = never; default: "
        f"{DEFAULT_LOCAL_PREFILL_TOKENS})",
    )
    kv_store_args.add_arguments(p)
    _add_media_flags(p)
    security_args.add_arguments(p)


def _add_media_flags(p) -> None:
    from services.gateway.media import MediaLimits

    g = p.add_argument_group("images (chat image_url parts)")
    g.add_argument("--max-images-per-request", type=int, default=MediaLimits.max_images)
    g.add_argument(
        "--max-image-bytes", type=int, default=MediaLimits.max_image_bytes, help="bytes of one encoded image"
    )
    g.add_argument(
        "--max-image-pixels", type=int, default=MediaLimits.max_image_pixels, help="width * height of one image"
    )
    g.add_argument(
        "--allowed-media-dir", default=None, help="file:// image URLs are read from under this directory only"
    )
    g.add_argument(
        "--allow-media-fetch", action="store_true", help="fetch http(s) image URLs (off: they are refused with 400)"
    )


def _encoders(args: argparse.Namespace) -> int:
    """--encoder, or its default: one for a P/D cluster of a model with a vision tower (NORMAL
    engines of a colocated cluster encode in process)."""
    if args.encoder is not None:
        if args.encoder < 0:
            raise ValueError("--encoder must be >= 0")
        return args.encoder
    if args.colocated:
        return 0
    from deepinfer_core.builtin import TINY_MODEL_DIR
    from services.gateway.media import VisionInfo

    return int(VisionInfo.from_model(args.model or TINY_MODEL_DIR) is not None)


def _media_limits(args: argparse.Namespace):
    from services.gateway.media import MediaLimits

    if args.max_images_per_request < 0 or args.max_image_bytes < 1 or args.max_image_pixels < 1:
        raise ValueError("--max-images-per-request must be >= 0, --max-image-bytes and --max-image-pixels >= 1")
    return MediaLimits(
        max_images=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        allowed_media_dir=args.allowed_media_dir,
        allow_fetch=args.allow_media_fetch,
    )


def config_from_args(args: argparse.Namespace):
    from services.controller.serve_config import HeadConfig

    _check_sizes(args)
    gpus = args.gpus_per_worker
    if gpus is None:
        import torch

        gpus = 1.0 if torch.cuda.is_available() and args.device != "cpu" else 0.0
    config = HeadConfig(
        encoder=_encoders(args),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        engine_args=_engine_settings(args),
        **security_args.head_settings(args),
        limits=RequestLimits(max_n=args.max_n, request_timeout_s=args.request_timeout),
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_sequences=args.max_concurrent_sequences,
        max_concurrent_prompt_tokens=args.max_concurrent_prompt_tokens,
        max_request_bytes=args.max_request_bytes,
        grpc_server=args.grpc_server,
        api_workers=args.api_workers,
        torch_threads=args.engine_threads,
        gpus_per_worker=gpus,
        num_cpus=args.num_cpus,
        ray_address=args.ray_address,
        autoscale=args.autoscale,
        pools_config=args.pools_config,
        cluster_host=args.cluster_host,
        migration_limit=args.migration_limit,
        stream_interval=args.stream_interval,
        log_level=args.log_level.upper(),
        media=_media_limits(args),
        decode_ep=args.decode_ep,
        prefill_ep=args.prefill_ep,
    )
    config.check_expert_parallel()
    return config


def _engine_settings(args: argparse.Namespace):
    """Every engine's settings, from the flags."""
    from deepinfer_core.config import PDConfig
    from services.workers.spec import EngineSettings

    return EngineSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        num_speculative_tokens=args.num_speculative_tokens,
        max_model_len=args.max_model_len or None,
        num_gpu_blocks=args.num_blocks or None,
        kv_store=kv_store_args.config_from_args(args),
        pd=PDConfig(local_prefill_tokens=args.local_prefill_tokens),
        eplb=_eplb(args),
        moe_dispatch=args.moe_dispatch,
    )


def _check_sizes(args: argparse.Namespace) -> None:
    if args.migration_limit < 0:
        raise ValueError("--migration-limit must be >= 0")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be at least 1")
    if args.api_workers < 1:
        raise ValueError("--api-workers must be at least 1")
    for name in ("prefill", "decode"):
        if getattr(args, name) < (0 if name == "prefill" and args.colocated else 1):
            raise ValueError(f"--{name} must be at least 1")


def _eplb(args: argparse.Namespace):
    if not (args.enable_eplb or args.redundant_experts or args.eplb_interval):
        return None
    from deepinfer_core.config import EplbConfig

    return EplbConfig(args.enable_eplb, args.redundant_experts, args.eplb_interval)


def run(args: argparse.Namespace) -> int:
    from services.metrics.multiprocess import shared_metrics

    # several API processes sum their metrics in files: set up before prometheus-client is imported
    with shared_metrics(enabled=args.api_workers > 1):
        from services.common.grpc_util import install_uvloop
        from services.controller.head import Head

        config = config_from_args(args)
        kv_store_args.check(config.engine_args.kv_store)
        install_uvloop()
        asyncio.run(Head(config).run())
    return 0
