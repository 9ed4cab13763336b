"""Moving bytes between a registered host buffer and objects of an S3-compatible bucket: NIXL's OBJ backend.

The counterpart of `storage_io.NixlFileIO` for a bucket. Items are `(host address, length, object
key)`: each moves one slot of the KV store's host pool to or from one whole object. The OBJ
plugin maps a descriptor's device id to an object key through the registration's `metaInfo`, so
each batch registers its objects (OBJ descriptors: offset 0, length, a device id, the key), posts
and polls, and deregisters them. A WRITE is one PUT per object (S3 makes an object visible whole
or not at all, so no temporary name is needed); a READ is one ranged GET. `exists` asks for a
whole prompt's objects in one call (NIXL's `query_memory`: HEAD requests side by side).

Writes post one transfer for the batch (NIXL reports it as one: a failure drops all of it). Reads
post one transfer per object, so that a failed GET (an object evicted since the lookup) ends the
prefix there instead of losing the blocks before it. A GET of a shorter object than asked for
succeeds with fewer bytes: the caller zeroes the slots first and its frame check catches the rest.

What NIXL's OBJ plugin does not do — create, list and delete objects — is `bucket.py`'s.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from urllib.parse import urlparse

import torch

from deepinfer_core.transfer.storage_io import StorageError, _quietly, run_transfer

logger = logging.getLogger(__name__)

Item = tuple[int, int, str]
"""(host address, bytes, object key)."""


REQUEST_THREADS = max(16, (os.cpu_count() or 2) // 2)
"""The OBJ plugin's threads for requests in flight (its `num_threads`; its default is half the
cores, one on a small host): each mostly waits on the network, and a lookup is a HEAD per block."""


SDK_RETRIES = {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "3"}
"""The plugin's AWS SDK takes its retries from these variables only (no backend parameter). Its
default (legacy mode, 10 attempts) holds a request to an endpoint that refuses connections for
about 25 s; standard mode with 3 attempts (boto3's default too) gives up within about 2.5 s. Set
by the store unless the deployment sets them."""


def obj_params(bucket: str, endpoint: str | None, region: str | None, env: dict[str, str]) -> dict[str, str]:
    """The OBJ backend's parameters (nixl src/plugins/obj/README.md); credentials come from the
    standard AWS variables in `env` (the plugin's SDK also falls back to its own credential chain)."""
    params = {
        "bucket": bucket,
        "region": region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        "num_threads": str(REQUEST_THREADS),
    }
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        params["endpoint_override"] = endpoint
        params["scheme"] = urlparse(endpoint).scheme or "https"
    for name, var in (
        ("access_key", "AWS_ACCESS_KEY_ID"),
        ("secret_key", "AWS_SECRET_ACCESS_KEY"),
        ("session_token", "AWS_SESSION_TOKEN"),
    ):
        if env.get(var):
            params[name] = env[var]
    return params


class NixlObjectIO:
    name = "OBJ"

    def __init__(self, name_prefix: str, params: dict[str, str], buffer: torch.Tensor | None = None):
        """`buffer`: the host memory transfers move (None: an agent that only asks what exists)."""
        from deepinfer_core.transfer.nixl_variant import api

        nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config
        for name, value in SDK_RETRIES.items():  # read when the backend builds its S3 client
            os.environ.setdefault(name, value)
        config = nixl_agent_config(enable_prog_thread=False, backends=[])
        self._agent = nixl_agent(f"{name_prefix}-obj-{uuid.uuid4().hex[:8]}", config)
        try:
            self._agent.create_backend("OBJ", dict(params))
        except Exception as e:
            from deepinfer_core.transfer.nixl_variant import chosen

            raise StorageError(
                f"NIXL's OBJ backend ({chosen()}) did not start: {e}; without CUDA, the nixl_cu12 build's plugin "
                "loads where nixl_cu13's lacks its CUDA 13 cuObject library (DEEPINFER_NIXL_VARIANT=nixl_cu12)"
            ) from e
        self._reg = self._agent.register_memory(buffer) if buffer is not None else None

    def exists(self, object_keys: list[str], size: int) -> list[bool]:
        """Whether each object is in the bucket (one HEAD each, all in one call)."""
        if not object_keys:
            return []
        try:
            answers = self._agent.query_memory([(0, size, i, k) for i, k in enumerate(object_keys)], "OBJ", "OBJ")
        except Exception as e:
            raise StorageError(f"asking the bucket for {len(object_keys)} objects failed: {e}") from e
        return [answer is not None for answer in answers]

    def write(self, items: list[Item], timeout_s: float) -> None:
        if not items:
            return
        agent = self._agent
        objects = self._register(items)
        handle = None
        try:
            handle = agent.initialize_xfer("WRITE", self._local(items), self._remote(items), agent.name)
            run_transfer(agent, handle, f"NIXL WRITE of {len(items)} objects", timeout_s, 0.0005)
        except StorageError:
            raise
        except Exception as e:  # NIXL_ERR_BACKEND: a PUT failed
            raise StorageError(f"NIXL WRITE of {len(items)} objects failed: {e}") from e
        finally:
            if handle is not None:
                _quietly(agent.release_xfer_handle, handle)
            _quietly(agent.deregister_memory, objects)

    def read(self, items: list[Item], timeout_s: float) -> int:
        """GET each object into its slot; returns how many, from the first, were read (the first
        failure, or the deadline, ends the count)."""
        if not items:
            return 0
        agent = self._agent
        objects = self._register(items)
        handles: list = []
        states: list[str] = []
        try:
            for i, item in enumerate(items):
                handle = agent.initialize_xfer("READ", self._local([item]), self._remote([item], first=i), agent.name)
                handles.append(handle)
                states.append(self._post(handle))
            deadline = time.monotonic() + timeout_s
            while "PROC" in states and time.monotonic() < deadline:
                time.sleep(0.0005)
                states = [self._check(h) if s == "PROC" else s for h, s in zip(handles, states)]
        except Exception as e:
            logger.warning("NIXL READ of %d objects failed: %s", len(items), e)
            states += ["ERR"] * (len(items) - len(states))
        finally:
            for handle in handles:
                _quietly(agent.release_xfer_handle, handle)
            _quietly(agent.deregister_memory, objects)
        done = 0
        while done < len(states) and states[done] == "DONE":
            done += 1
        if done < len(items):
            logger.info("read %d of %d objects (next: %s, %s)", done, len(items), items[done][2], states[done])
        return done

    def _post(self, handle) -> str:
        try:
            return self._agent.transfer(handle)
        except Exception:  # a GET that fails at once (no such object)
            return "ERR"

    def _check(self, handle) -> str:
        try:
            return self._agent.check_xfer_state(handle)
        except Exception:
            return "ERR"

    def _register(self, items: list[Item]):
        try:
            return self._agent.register_memory([(0, n, i, key) for i, (_, n, key) in enumerate(items)], "OBJ")
        except Exception as e:
            raise StorageError(f"registering {len(items)} objects with NIXL failed: {e}") from e

    def _local(self, items: list[Item]):
        return self._agent.get_xfer_descs([(addr, n, 0) for addr, n, _ in items], "DRAM")

    def _remote(self, items: list[Item], first: int = 0):
        return self._agent.get_xfer_descs([(0, n, first + i) for i, (_, n, _) in enumerate(items)], "OBJ")

    def close(self) -> None:
        if self._reg is not None:
            _quietly(self._agent.deregister_memory, self._reg)
            self._reg = None
