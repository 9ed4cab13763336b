"""Every rank of an instance steps together, and none waits forever.

A rank's host calls `LockstepRank.step()` in its loop, whether it has work or not. Each call is
one beat: a one-integer all-reduce asks whether any rank has work. If none has, the beat ends
(the host may sleep a moment). If any has, every rank runs `engine.step()`: a rank with nothing
scheduled runs a dummy step (`ModelRunner`: zero tokens through each MoE layer, or the empty
prefill's placeholder token), so every MoE all-to-all and every DP vote is entered by every rank.

Failure: gloo raises once `collective_timeout_s` passes or a peer's socket closes (the rank was
killed); that surfaces as `InstanceFailed`. `StepWatchdog` is the backstop for a backend that
blocks past its timeout (NCCL without async error handling): if one beat takes longer than its
limit, it calls `on_stuck` (default: log and exit the process, which the host's supervisor — the
controller, the router's health checks — sees as the instance failing).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Optional

from deepinfer_core.distributed.group import InstanceFailed, InstanceGroup

logger = logging.getLogger(__name__)

EXIT_STUCK = 70
"""Exit status of a process the watchdog ends (EX_SOFTWARE)."""


def exit_instance(message: str) -> None:
    """Log and end this process at once: the default answer to a stuck step or a dead peer."""
    logger.critical("%s; failing the instance", message)
    logging.shutdown()
    os._exit(EXIT_STUCK)


class StepWatchdog:
    """A daemon thread failing the process when one guarded beat exceeds `timeout_s`."""

    def __init__(self, timeout_s: float, name: str, on_stuck: Callable[[str], None] = exit_instance):
        self.timeout_s = timeout_s
        self.name = name
        self.on_stuck = on_stuck
        self._started: Optional[float] = None  # monotonic start of the beat in progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._stop.set()
                self.on_stuck(f"{self.name}: a step has been stuck for more than {self.timeout_s:.0f} s")


class PeerMonitor:
    """A daemon thread that notices a dead peer while this rank may be blocked in a collective.

    Each rank bumps its counter `beat/<rank>` in the instance's store every `period_s`; a peer
    whose counter has not moved for `timeout_s` (killed, frozen), or a store that stops answering
    (rank 0, its host, is gone), calls `on_stuck`. Counters, not clocks: nodes need no common time.
    """

    def __init__(self, group: InstanceGroup, timeout_s: float, on_stuck: Callable[[str], None] = exit_instance,
                 period_s: float = 0.5):  # fmt: skip
        if group.store is None:
            raise ValueError("a peer monitor needs the instance's store (join_instance)")
        self.group = group
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"peers-{group.rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        g = self.group
        peers = [r for r in range(g.size) if r != g.rank]
        seen = {r: (None, time.monotonic()) for r in peers}  # rank -> (last counter, when it moved)
        try:
            while not self._stop.wait(self.period_s):
                g.store.add(f"beat/{g.rank}", 1)
                for r in peers:
                    value = g.store.add(f"beat/{r}", 0)  # read without waiting for the key
                    if value != seen[r][0]:
                        seen[r] = (value, time.monotonic())
                    elif time.monotonic() - seen[r][1] > self.timeout_s:
                        self._stop.set()
                        return self.on_stuck(f"rank {g.rank}/{g.size}: rank {r} stopped answering for "
                                             f"{self.timeout_s:.0f} s")  # fmt: skip
        except Exception as e:  # the store's host (rank 0) is gone
            if not self._stop.is_set():
                self.on_stuck(f"rank {g.rank}/{g.size}: the instance's store stopped answering ({type(e).__name__})")


class LockstepRank:
    """One rank's lockstep driver around its engine."""

    def __init__(self, engine, group: InstanceGroup, watchdog_timeout_s: Optional[float] = None,
                 on_stuck: Callable[[str], None] = exit_instance,
                 peer_timeout_s: Optional[float] = None):  # fmt: skip
        """`peer_timeout_s`: also watch the peers (`PeerMonitor`) and call `on_stuck` when one stops
        beating for that long: a killed rank is noticed before the collectives time out."""
        self.engine = engine
        self.group = group
        limit = watchdog_timeout_s if watchdog_timeout_s is not None else 2 * group.collective_timeout_s
        self.watchdog = StepWatchdog(limit, f"rank {group.rank}/{group.size}", on_stuck)
        self.peers = PeerMonitor(group, peer_timeout_s, on_stuck) if peer_timeout_s else None
        self.num_beats = 0
        self.num_steps = 0
        self.instance_busy = True
        """Whether the last beat found work on any rank (False: the whole instance was idle)."""
        self.failed: Optional[str] = None
        """Why the instance failed (this rank stops stepping); None while healthy."""

    @property
    def num_dummy_steps(self) -> int:
        return self.engine.worker.runner.num_dummy_steps

    def step(self) -> list:
        """One beat; the engine's outputs when the instance stepped.

        Raises:
            InstanceFailed: a peer is gone or a collective broke; this rank must not step again.
        """
        if self.failed is not None:
            raise InstanceFailed(self.failed)
        self.watchdog.begin()
        try:
            self.num_beats += 1
            self.instance_busy = self.group.any(self.engine.has_unfinished_requests())
            if not self.instance_busy:
                return []
            self.num_steps += 1
            return self.engine.step()
        except InstanceFailed as e:
            self.failed = str(e)
            raise
        except RuntimeError as e:  # a collective inside the step (DP vote) raised
            self.failed = f"rank {self.group.rank}/{self.group.size}: step failed: {e}"
            raise InstanceFailed(self.failed) from e
        finally:
            self.watchdog.end()

    def close(self) -> None:
        self.watchdog.close()
        if self.peers is not None:
            self.peers.close()
