"""`deepinfer serve` in a subprocess, on free ports, for end-to-end tests."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

_READY = re.compile(r"OpenAI API at (https?://\S+)/v1 , gRPC at (\S+) ")
_RAY = re.compile(r"Ray cluster at (\S+)")
_ROUTER = re.compile(r"router at (\S+) ")
_API_PROCESS = re.compile(r"API process (\d+) serving \(pid (\d+)\)")

SMALL_ENGINE = ["--num-blocks", "512", "--block-size", "16", "--max-model-len", "512"]
"""Small KV caches: 512 blocks of 16 tokens per engine."""


def _isolated(args: tuple[str, ...], store_dir: str) -> list[str]:
    """Defaults that keep one test's cluster from another's: the P/D path for every prompt (tests of
    conditional disaggregation pass `--local-prefill-tokens`), and a KV store of its own."""
    extra = []
    if "--local-prefill-tokens" not in args:
        extra += ["--local-prefill-tokens", "0"]
    if not {"--kv-store-dir", "--kv-store-url", "--no-kv-store"} & set(args):
        extra += ["--kv-store-dir", store_dir]
    return [*extra, *args]


class ServeProcess:
    def __init__(self, *args: str, start_timeout_s: float = 240.0, env: Optional[dict] = None):
        """`env`: variables added to this environment."""
        self._store = tempfile.TemporaryDirectory(prefix="deepinfer-kv-store-")
        cmd = [
            *(sys.executable, "-m", "services.cli.main", "serve", "--port", "0", "--grpc-port", "0"),
            *_isolated(args, self._store.name),
        ]
        # token auth on both the cluster that starts Ray and those that join it (`--ray-address`)
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", **(env or {})}
        env.setdefault("DEEPINFER_CLUSTER_TOKEN", secrets.token_urlsafe(24))  # a --cluster-token flag wins
        self.cluster_token = env["DEEPINFER_CLUSTER_TOKEN"]
        """The internal services' credential (tests that call a worker directly send it)."""
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url: Optional[str] = None
        self.grpc_address: Optional[str] = None
        self.router_address: Optional[str] = None
        """The head's router server (internal)."""
        self.ray_address: Optional[str] = None
        """The Ray cluster's address: another `serve --ray-address` can join it (saves a Ray start)."""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(start_timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("deepinfer serve did not become ready:\n" + "".join(self.lines[-50:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            ray_match = _RAY.search(line)
            if ray_match:
                self.ray_address = ray_match.group(1)
            router_match = _ROUTER.search(line)
            if router_match:
                self.router_address = router_match.group(1)
            match = _READY.search(line)
            if match:
                self.url, self.grpc_address = match.group(1), match.group(2)
                self._ready.set()
        self._ready.set()

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def error_output(self, most: int = 80) -> str:
        """The server's tracebacks and error lines so far (the last `most` lines of them), for a
        failing test's message."""
        picked, in_traceback = [], False
        for line in list(self.lines):
            if line.startswith("Traceback") or "ERROR" in line or "Error" in line:
                in_traceback = in_traceback or line.startswith("Traceback")
                picked.append(line)
            elif in_traceback:
                picked.append(line)
                in_traceback = (
                    line.startswith((" ", "\t", "During handling", "The above exception")) or not line.strip()
                )
        return "".join(picked[-most:])

    def api_pids(self) -> dict[int, int]:
        """Pid of each API process (`--api-workers`), the head's as 0; the latest start of each."""
        pids = {0: self.proc.pid}
        for line in list(self.lines):
            match = _API_PROCESS.search(line)
            if match:
                pids[int(match.group(1))] = int(match.group(2))
        return pids

    def wait_for_output(self, pattern: str, timeout_s: float = 60.0) -> Optional[re.Match]:
        """The first line of the server's output that matches `pattern`, waiting up to `timeout_s`."""
        regex = re.compile(pattern)
        return wait_until(lambda: next((m for m in map(regex.search, list(self.lines)) if m), None), timeout_s)

    def metric(self, name: str, **labels) -> float:
        """A metric of the gateway's /metrics now, summed over the series that carry `labels`."""
        import httpx

        return metric_value(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def cli(self, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
        """Run `deepinfer <args> --address <this cluster>`."""
        cmd = [sys.executable, "-m", "services.cli.main", *args, "--address", self.grpc_address]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._store.cleanup()


def metric_value(text: str, name: str, **labels) -> float:
    """The sum of the Prometheus series `name` in `text` that carry `labels` (0 when none does)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            if re.match(rf"{re.escape(name)}(\{{|\s)", line):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
