"""`deepinfer serve`'s security flags: API keys, the gateway's TLS, the cluster token, reflection.

Keys and the token may come from the environment (`DEEPINFER_API_KEYS`, `DEEPINFER_CLUSTER_TOKEN`)
so that a Kubernetes Secret feeds them without putting them on a command line (`docs/security.md`).
"""

from __future__ import annotations

import argparse
import os

API_KEYS_ENV = "DEEPINFER_API_KEYS"
"""API keys, comma-separated (beside --api-key and --api-key-file)."""
CLUSTER_TOKEN_ENV = "DEEPINFER_CLUSTER_TOKEN"
"""The cluster token when --cluster-token is not given."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1/* and gRPC; repeat for several keys, any of which is "
        f"accepted (also: --api-key-file, ${API_KEYS_ENV})",
    )
    p.add_argument(
        "--api-key-file", default=None, help="a file of API keys, one a line (blank lines and # comments skipped)"
    )
    p.add_argument(
        "--ssl-certfile", default=None, help="serve HTTPS and gRPC over TLS with this certificate chain (PEM)"
    )
    p.add_argument(
        "--ssl-keyfile", default=None, help="the certificate's private key (PEM; default: in --ssl-certfile)"
    )
    p.add_argument(
        "--ssl-ca-certs", default=None, help="require client certificates signed by these CAs (PEM), on HTTP and gRPC"
    )
    p.add_argument(
        "--cluster-token",
        default=None,
        help=f"the internal services' credential (default: ${CLUSTER_TOKEN_ENV}, else one made for this cluster); "
        "workers started outside this head need it",
    )
    p.add_argument(
        "--internal-grpc-reflection",
        action="store_true",
        help="the router's and the workers' gRPC servers serve reflection (default: off; the gateway's is on)",
    )


def head_settings(args: argparse.Namespace) -> dict:
    """HeadConfig's security fields from the parsed flags and the environment."""
    settings = {
        "api_keys": api_keys(args),
        "tls": tls_config(args),
        "internal_reflection": args.internal_grpc_reflection,
    }
    token = args.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV, "")
    if token:  # else HeadConfig makes one
        settings["cluster_token"] = token
    return settings


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every API key given: the flags, the key file and $DEEPINFER_API_KEYS (comma-separated, as a
    Kubernetes Secret may be mounted as a variable), duplicates dropped."""
    keys = list(args.api_key)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            keys += [line.strip() for line in f if not line.lstrip().startswith("#")]
    keys += os.environ.get(API_KEYS_ENV, "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def tls_config(args: argparse.Namespace):
    from services.gateway.tls import TLSConfig

    tls = TLSConfig(certfile=args.ssl_certfile, keyfile=args.ssl_keyfile, ca_certs=args.ssl_ca_certs)
    tls.check()
    return tls
