"""Starting `deepinfer serve` for one configuration of a sweep, and stopping it and all it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Optional

from services.bench.sweep.configs import ServeConfig

_READY = re.compile(r"OpenAI API at (http://\S+)/v1 ")


class ServerFailed(RuntimeError):
    """`deepinfer serve` exited or did not become ready in time."""


class LaunchedServer:
    """`deepinfer serve` on free ports in its own process group, its output copied to `log_path`."""

    def __init__(self, config: ServeConfig, extra_args: list[str], log_path: str):
        cmd = [sys.executable, "-m", "services.cli.main", "serve", "--port", "0", "--grpc-port", "0"]
        cmd += [*config.serve_args, *extra_args]
        self.command = cmd
        self.log_path = log_path
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._log = open(log_path, "w", encoding="utf-8")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        if not any(a.startswith("--ray-address") for a in extra_args):
            # A Ray cluster left running on this machine (`ray start`) would otherwise be joined: each
            # configuration gets a Ray of its own, so that one's leftovers cannot skew the next.
            env["RAY_ADDRESS"] = "local"
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self._copier = threading.Thread(target=self._copy_output, daemon=True)
        self._copier.start()

    def _copy_output(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            match = _READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # it exited: wake the waiter

    def wait_ready(self, timeout_s: float) -> str:
        """The server's base URL (http://host:port); raises ServerFailed."""
        if not self._ready.wait(timeout_s) and self.url is None:
            raise ServerFailed(f"not ready after {timeout_s:.0f} s (its output: {self.log_path})")
        if self.url is None:
            raise ServerFailed(
                f"exited with status {self.proc.wait()} before it was ready (its output: {self.log_path})"
            )
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ctrl-C first, so that it shuts its Ray cluster down; then kill its whole process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it left behind in its group
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._copier.join(10)
        self._log.close()
