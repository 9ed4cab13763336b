"""Moving bytes between a registered host buffer and files: NIXL's POSIX storage backend, or plain I/O.

Both take a batch of `(host address, length, file descriptor)`: one transfer moves a run of entries,
each between one slot of the KV store's host pool and offset 0 of its own file. The caller opens,
creates and renames the files; this layer only moves bytes, and raises `StorageError` when any part
of a batch fails (NIXL reports a batch as one) or it runs past its deadline.

NIXL (`NixlFileIO`): the host buffer is registered once for the POSIX backend (DRAM); each batch
registers its files (FILE descriptors: offset, length, fd), posts one READ or WRITE and polls it
to completion. With the backend's default queue the post itself does the I/O; io_uring or AIO
(`params`, e.g. {"use_uring": "true"}) complete it asynchronously. Either way this runs on the
store's I/O thread, never on an engine step. A short read (a truncated file) fails the batch.

Plain I/O (`PlainFileIO`): `os.preadv` / `os.pwritev` into the same buffer, for machines without
the nixl package, and as a reference in tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import uuid

import torch

logger = logging.getLogger(__name__)

Item = tuple[int, int, int]
"""(host address, bytes, file descriptor)."""


class StorageError(RuntimeError):
    pass


class PlainFileIO:
    name = "FILE"

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def write(self, items: list[Item], timeout_s: float) -> None:
        self._run(items, write=True)

    def read(self, items: list[Item], timeout_s: float) -> None:
        self._run(items, write=False)

    @staticmethod
    def _run(items: list[Item], write: bool) -> None:
        for addr, nbytes, fd in items:
            view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
            try:
                done = os.pwritev(fd, [view], 0) if write else os.preadv(fd, [view], 0)
            except OSError as e:
                raise StorageError(f"file {'write' if write else 'read'} failed: {e}") from e
            if done != nbytes:
                raise StorageError(f"short file {'write' if write else 'read'}: {done} of {nbytes} bytes")

    def close(self) -> None:
        pass


class NixlFileIO:
    name = "POSIX"

    def __init__(self, name_prefix: str, buffer: torch.Tensor, params: dict[str, str] | None = None):
        from deepinfer_core.transfer.nixl_variant import api  # lazy: engines without a store never import nixl

        nixl_agent, nixl_agent_config = api().nixl_agent, api().nixl_agent_config

        self.buffer = buffer
        # No progress thread: storage transfers are driven by polling on the I/O thread.
        config = nixl_agent_config(enable_prog_thread=False, backends=[])
        self._agent = nixl_agent(f"{name_prefix}-store-{uuid.uuid4().hex[:8]}", config)
        self._agent.create_backend("POSIX", dict(params or {}))
        self._reg = self._agent.register_memory(buffer)

    def write(self, items: list[Item], timeout_s: float) -> None:
        self._transfer("WRITE", items, timeout_s)

    def read(self, items: list[Item], timeout_s: float) -> None:
        self._transfer("READ", items, timeout_s)

    def _transfer(self, op: str, items: list[Item], timeout_s: float) -> None:
        if not items:
            return
        agent = self._agent
        try:
            files = agent.register_memory([(0, n, fd, "") for _, n, fd in items], "FILE")
        except Exception as e:
            raise StorageError(f"registering {len(items)} files with NIXL failed: {e}") from e
        handle = None
        try:
            local = agent.get_xfer_descs([(addr, n, 0) for addr, n, _ in items], "DRAM")
            remote = agent.get_xfer_descs([(0, n, fd) for _, n, fd in items], "FILE")
            handle = agent.initialize_xfer(op, local, remote, agent.name)
            run_transfer(agent, handle, f"NIXL {op} of {len(items)} files", timeout_s, 0.0002)
        except StorageError:
            raise
        except Exception as e:  # NIXL_ERR_BACKEND: an I/O error or a short read in the batch
            raise StorageError(f"NIXL {op} of {len(items)} files failed: {e}") from e
        finally:
            if handle is not None:
                _quietly(agent.release_xfer_handle, handle)
            _quietly(agent.deregister_memory, files)

    def close(self) -> None:
        if self._reg is not None:
            _quietly(self._agent.deregister_memory, self._reg)
            self._reg = None


def run_transfer(agent, handle, what: str, timeout_s: float, poll_s: float) -> None:
    """Post a prepared transfer of this process's agent and wait until it is done; a failure or the
    deadline is a `StorageError` naming `what`."""
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state == "PROC":
        if time.monotonic() > deadline:
            raise StorageError(f"{what} did not finish in {timeout_s:.1f}s")
        time.sleep(poll_s)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise StorageError(f"{what} failed ({state})")


def open_file_io(backend: str, name_prefix: str, buffer: torch.Tensor):
    """The store's file mover: NIXL's POSIX backend where nixl imports, else plain I/O (logged)."""
    if backend == "POSIX":
        try:
            return NixlFileIO(name_prefix, buffer)
        except ImportError as e:
            logger.warning("nixl is not importable (%s): the KV store uses plain file I/O", e)
    return PlainFileIO(buffer)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # releasing after a failure may fail too; nothing more can be done
        logger.debug("NIXL release failed: %s", e)
