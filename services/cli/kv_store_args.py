"""`deepinfer serve`'s KV store flags: the store is on by default, under the user's cache directory.

Every PE and CE of the cluster gets the same `KVStoreConfig`; a directory on a shared filesystem
(NFS, Lustre, 3FS) makes the store cluster-wide, a local one serves the engines of one machine, and
`--kv-store-url s3://bucket[/prefix]` puts it in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW:
`--kv-store-endpoint`), reached with the standard AWS credentials of the environment. `check` is
what `serve` runs before it starts anything: a bucket that does not answer, or a NIXL without a
working OBJ plugin, stops it with the cause.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Optional

DEFAULT_L3_BYTES = 2 * 2**30
DEFAULT_L2_BYTES = 128 * 2**20
"""Modest defaults: a development machine keeps 2 GiB of entry files and 128 MiB of host pool per
engine; a GPU node raises both (the pool is staging for every save and load as well as a tier)."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain count of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MB, 1000000)")
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


def default_store_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "deepinfer", "kv-store")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-store-dir",
        default=None,
        help="directory of the KV store's entry files, shared by every prefill and decode engine pointed at it "
        f"(a shared filesystem makes it cluster-wide; default: {default_store_dir()})",
    )
    p.add_argument(
        "--kv-store-url",
        default=None,
        metavar="s3://BUCKET[/PREFIX]",
        help="keep the KV store's entries as objects in an S3-compatible bucket instead of a directory (moved "
        "by NIXL's OBJ backend; credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, "
        "a profile or an instance role)",
    )
    p.add_argument(
        "--kv-store-endpoint",
        default=None,
        metavar="URL",
        help="the bucket's S3-compatible endpoint, e.g. http://minio:9000 (default: AWS S3, or AWS_ENDPOINT_URL)",
    )
    p.add_argument(
        "--kv-store-region",
        default=None,
        help="the bucket's region (default: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)",
    )
    p.add_argument(
        "--kv-store-bytes",
        type=parse_bytes,
        default=DEFAULT_L3_BYTES,
        help="most bytes of entries in the directory or bucket, all engines together; least recently used go "
        "first (default: 2GiB)",
    )
    p.add_argument(
        "--kv-host-bytes",
        type=parse_bytes,
        default=DEFAULT_L2_BYTES,
        help="each engine's host-memory pool: the store's L2 tier and staging for its reads and writes (default: 128MiB)",
    )
    p.add_argument("--no-kv-store", action="store_true", help="no KV store: prefixes live only in each engine's cache")


def config_from_args(args: argparse.Namespace):
    """The `KVStoreConfig` of every engine (deepinfer_core imported here: `deepinfer status` needs no torch)."""
    from deepinfer_core.config import KVStoreConfig

    if args.no_kv_store:
        return KVStoreConfig()
    sizes = {"l2_bytes": args.kv_host_bytes, "l3_bytes": args.kv_store_bytes}
    if args.kv_store_url is not None:
        if args.kv_store_dir is not None:
            raise ValueError("--kv-store-dir and --kv-store-url are two places for one store: give one")
        return KVStoreConfig(
            url=args.kv_store_url, endpoint=args.kv_store_endpoint, region=args.kv_store_region, **sizes
        )
    if args.kv_store_endpoint is not None or args.kv_store_region is not None:
        raise ValueError("--kv-store-endpoint and --kv-store-region need --kv-store-url s3://bucket[/prefix]")
    directory: Optional[str] = args.kv_store_dir or default_store_dir()
    return KVStoreConfig(directory=directory, **sizes)


def check(config) -> None:
    """Raise ValueError naming the cause unless the store's bucket answers and NIXL's OBJ backend
    starts on this host (a directory store needs nothing checked: engines create it)."""
    if config.url is None:
        return
    from deepinfer_core.kvstore.object_tier import check_bucket

    check_bucket(config)
