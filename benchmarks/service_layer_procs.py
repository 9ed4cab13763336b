"""Processes of the service-layer benchmark: start them, talk to them over stdin/stdout, read
their CPU time, and make sure none outlives the benchmark.

Each child prints one JSON object per line on stdout (its replies) and takes one JSON object per
line on stdin (commands); its log goes to a file, shown when it fails. A child asks the kernel to
kill it when its parent dies (`die_with_parent`) and exits when its stdin closes, so a benchmark
that is killed leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PR_SET_PDEATHSIG = 1
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def prepare_child() -> None:
    """First thing in a child: die with the parent, and take as many sockets as allowed (a level
    of 1,024 SSE streams holds 1,024 connections in the head and among the clients)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))
    die_with_parent()


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def reply(obj: dict[str, Any]) -> None:
    """A child's answer to its parent: one JSON line on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands():
    """A child's commands from its parent, until stdin closes."""
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


class ChildError(RuntimeError):
    pass


class Child:
    """One child process (`python -m <module> <args>`), its reply queue and its log."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO_ROOT,
                env=env,
            )
        self.pid = self.proc.pid
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._replies.put(json.loads(line))
        self._replies.put(None)  # stdout closed: the child is gone

    def expect(self, timeout_s: float) -> dict[str, Any]:
        """The child's next reply; raises ChildError when it exits or stays silent too long."""
        try:
            obj = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ChildError(f"{self.name} did not answer within {timeout_s:.0f} s\n{self.log_tail()}") from None
        if obj is None:
            raise ChildError(f"{self.name} exited (code {self.proc.poll()})\n{self.log_tail()}")
        if "error" in obj:
            raise ChildError(f"{self.name}: {obj['error']}\n{self.log_tail()}")
        return obj

    def send(self, obj: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def ask(self, obj: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        self.send(obj)
        return self.expect(timeout_s)

    def wait(self, timeout_s: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 3.0) -> None:
        """Close its stdin (a polite stop), then SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            if self.wait(grace_s) is None:
                self.proc.terminate()
                if self.wait(grace_s) is None:
                    self.proc.kill()
                    self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class Children:
    """Every child the benchmark started; `stop_all` in a `finally` so none is left running."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(self, name: str, module: str, args: list[str]) -> Child:
        child = Child(name, module, args, self.log_dir)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children = []


def cpu_times(pid: int) -> tuple[float, float]:
    """(CPU seconds of `pid`'s live threads from the scheduler's nanosecond counters, CPU seconds
    of the whole process from /proc/<pid>/stat in clock ticks), user + system; (0, 0) once gone."""
    sched = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    sched += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return sched / 1e9, (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_delta(before: tuple[float, float], after: tuple[float, float]) -> float:
    """CPU seconds spent between two `cpu_times` samples: the nanosecond counters, unless the
    tick counters saw clearly more (threads that ended in between took their time with them)."""
    sched, ticks = after[0] - before[0], after[1] - before[1]
    return ticks if ticks > sched + 2.0 / _CLK_TCK else sched


def sleep_until(deadline: float) -> None:
    """Sleep until the monotonic clock reads `deadline`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))
