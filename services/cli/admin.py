"""What `deepinfer scale` and `deepinfer status` share: the admin client and the status table."""

from __future__ import annotations

import argparse

from proto import common_pb2

POOL_LABELS = {1: "encoder", 2: "prefill", 3: "decode", 4: "colocated"}


def add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="the gateway's gRPC address (default: 127.0.0.1:50051)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")


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
        lines.append(f"{name} pool: {len(pool.workers)} worker(s), target {pool.target}")
        if pool.workers:
            lines.append(header)
        for w in pool.workers:
            load = w.load
            lines.append(
                f"  {w.info.worker_id:<16} {w.state:<9} {w.info.address:<22} {w.inflight:>8} "
                f"{load.running_requests:>7} {load.waiting_requests:>7} {load.kv_usage:>6.1%} {load.free_blocks:>8}"
                f" {_ep_columns(load)}"
            )
    return "\n".join(lines)


def _ep_columns(load) -> str:
    """An expert-parallel rank's place in its instance, the instance's expert-load imbalance, its dummy steps."""
    if load.ep_size <= 1:
        return f"{'-':>7} {'-':>7} {'-':>7}"
    imbalance = f"{load.moe_load_imbalance:.2f}" if load.moe_load_imbalance else "-"
    return f"{f'{load.ep_rank}/{load.ep_size}':>7} {imbalance:>7} {load.dummy_steps:>7}"


def call(args, method: str, request):
    import grpc

    from proto import gateway_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        stub = gateway_pb2_grpc.ClusterStub(channel)
        try:
            return getattr(stub, method)(request, timeout=args.timeout, metadata=metadata(args))
        except grpc.RpcError as e:
            raise ValueError(f"{args.address}: {e.code().name}: {e.details()}") from None
