"""`deepinfer scale --prefill N --decode N --encoder N`: resize the pools of a running cluster."""

from __future__ import annotations

import argparse

from services.cli import admin


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="change pool sizes of a running cluster (removed workers drain first)")
    p.add_argument("--prefill", type=int, default=None, help="prefill engines (instances of --prefill-ep ranks each)")
    p.add_argument("--decode", type=int, default=None, help="decode engines (instances of --decode-ep ranks each)")
    p.add_argument("--colocated", type=int, default=None, help="NORMAL engines (a --colocated cluster)")
    p.add_argument("--encoder", type=int, default=None, help="vision encoders (a cluster started with --encoder >= 1)")
    admin.add_address(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer_proto import gateway_pb2

    names = ("prefill", "decode", "colocated", "encoder")
    wanted = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if not wanted:
        raise ValueError("give at least one of --prefill, --decode, --colocated, --encoder")
    print(f"scaling to {', '.join(f'{v} {k}' for k, v in wanted.items())} ...", flush=True)
    request = gateway_pb2.ScaleRequest(timeout_s=args.timeout, **wanted)
    print(admin.format_status(admin.call(args, "Scale", request)))
    return 0
