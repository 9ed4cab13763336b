"""`deepinfer status`: pools, workers and their load."""

from __future__ import annotations

import argparse

from services.cli import admin


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show the pools, workers and load of a running cluster")
    admin.add_address(p)
    p.set_defaults(func=run, timeout=10.0)


def run(args: argparse.Namespace) -> int:
    from deepinfer_proto import common_pb2

    print(admin.format_status(admin.call(args, "Status", common_pb2.StatusRequest())))
    return 0
