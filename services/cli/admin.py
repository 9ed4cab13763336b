"""What `deepinfer scale` and `deepinfer status` share: the admin client and the status table."""

from __future__ import annotations

import argparse

from deepinfer_proto import common_pb2
from services.cli import status_lines

POOL_LABELS = {1: "encoder", 2: "prefill", 3: "decode", 4: "colocated"}


def add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="the gateway's gRPC address (default: 127.0.0.1:50051)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    p.add_argument("--ssl-ca-certs", default=None, help="TLS: trust the server's certificate from these CAs (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="TLS: this client certificate (PEM), for a server that asks")
    p.add_argument("--ssl-keyfile", default=None, help="TLS: the client certificate's key (PEM)")


def metadata(args) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.api_key}")] if args.api_key else []


def format_status(status: common_pb2.ClusterStatus) -> str:
    lines = [f"model {status.model}: {'ready' if status.ready else 'NOT ready'}"]
    if status.detail and status.detail != "ok":  # why not ready, or an engine waiting for a node
        lines.append(f"  {status.detail}")
    header = (
        f"  {'worker':<16} {'state':<9} {'address':<22} {'inflight':>8} {'running':>7} {'waiting':>7} "
        f"{'kv use':>7} {'free blk':>8} {'ep rank':>7} {'moe imb':>7} {'dummy':>7}"
    )
    for pool in status.pools:
        name = POOL_LABELS.get(pool.pool, str(pool.pool))
        lines.append(f"{name} pool: {status_lines.pool_size(pool)}")
        if pool.workers:
            lines.append(header)
        if pool.pool == common_pb2.POOL_PREFILL and pool.workers:
            lines.insert(len(lines) - 1, status_lines.PREFILL_SCORE)
        for w in pool.workers:
            load = w.load
            lines.append(
                f"  {w.info.worker_id:<16} {w.state:<9} {w.info.address:<22} {w.inflight:>8} "
                f"{load.running_requests:>7} {load.waiting_requests:>7} {load.kv_usage:>6.1%} {load.free_blocks:>8}"
                f" {_ep_columns(load)}"
            )
            lines.append(status_lines.cache_line(w))
    return "\n".join(lines)


def _ep_columns(load) -> str:
    """An expert-parallel rank's place in its instance, the instance's expert-load imbalance, its dummy steps."""
    if load.ep_size <= 1:
        return f"{'-':>7} {'-':>7} {'-':>7}"
    imbalance = f"{load.moe_load_imbalance:.2f}" if load.moe_load_imbalance else "-"
    return f"{f'{load.ep_rank}/{load.ep_size}':>7} {imbalance:>7} {load.dummy_steps:>7}"


def call(args, method: str, request):
    import grpc

    from deepinfer_proto import gateway_pb2_grpc

    with _channel(args) as channel:
        stub = gateway_pb2_grpc.ClusterStub(channel)
        try:
            return getattr(stub, method)(request, timeout=args.timeout, metadata=metadata(args))
        except grpc.RpcError as e:
            raise ValueError(f"{args.address}: {e.code().name}: {e.details()}") from None


def _channel(args):
    """Over TLS when any TLS option is given (the system's CAs when --ssl-ca-certs is not)."""
    import grpc

    if not (args.ssl_ca_certs or args.ssl_certfile):
        return grpc.insecure_channel(args.address)

    def read(path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    key = read(args.ssl_keyfile) or read(args.ssl_certfile)
    credentials = grpc.ssl_channel_credentials(
        read(args.ssl_ca_certs), key if args.ssl_certfile else None, read(args.ssl_certfile)
    )
    return grpc.secure_channel(args.address, credentials)
