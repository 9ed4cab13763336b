"""`deepinfer serve` on one machine: every internal listener on the loopback interface.

The router and the workers bind `--cluster-host` themselves. Ray and UCX (under NIXL) choose their
own addresses, so the head sets them up before Ray starts; Ray's processes, and the workers they
start, inherit the environment:

- Ray resolves a loopback node address to the machine's own one unless it is told the cluster has a
  single machine (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the switch Ray has for laptops); then its
  GCS, raylet, core-worker, runtime-env agent and autoscaler monitor listen on 127.0.0.1.
- UCX's TCP transport listens on every network device; `UCX_NET_DEVICES=lo` keeps it (and every
  network transport of UCX) on loopback. Shared memory carries the KV between engines of one
  machine either way. An operator's own UCX setting wins.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
UCX_LOOPBACK = {"UCX_NET_DEVICES": "lo"}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def prepare_ray(ray_address: Optional[str], cluster_host: str) -> Optional[str]:
    """Set this process up before Ray starts (no `ray_address`) or is joined; returns the node
    address for `ray.init` (None: Ray's choice)."""
    if ray_address:
        if address_is_loopback(ray_address):
            keep_ray_on_loopback()
        return None
    if not is_loopback(cluster_host):
        return None
    bind_to_loopback()
    return "127.0.0.1"


def bind_to_loopback() -> None:
    """Set up Ray and UCX to listen on loopback only, for a Ray cluster this process starts."""
    keep_ray_on_loopback()
    for name, value in UCX_LOOPBACK.items():
        os.environ.setdefault(name, value)


def keep_ray_on_loopback() -> None:
    """Ray keeps a loopback node address: for starting a cluster on loopback, and for joining one
    (a driver otherwise looks for its node under the machine's address and finds none)."""
    os.environ[_RAY_SINGLE_MACHINE] = "0"
    ray_constants = sys.modules.get("ray._private.ray_constants")
    if ray_constants is not None:  # read at Ray's import: a Ray imported already needs telling too
        ray_constants.ENABLE_RAY_CLUSTER = False


def address_is_loopback(address: str) -> bool:
    """A Ray address (host:port) on loopback."""
    return is_loopback(address.rsplit(":", 1)[0].strip("[]"))
