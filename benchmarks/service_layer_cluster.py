"""The processes under test and one load level against them.

`Cluster` starts the head (router + gateway) and the token-source workers. `run_level` runs S
streams of one protocol from client processes: they start together; once the ramp is over
(`wait_ramp`) and a warm-up has passed, the CPU time of every process is sampled at both ends of
a steady-state window; then the clients cancel what is open and report what they got.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from benchmarks.service_layer_analysis import Emissions, Window, level_numbers
from benchmarks.service_layer_procs import Child, Children, cpu_delta, cpu_times, sleep_until

_API = "api-process-"


@dataclass(frozen=True)
class LoadOptions:
    step_ms: float = 20.0
    tokens_per_step: int = 1
    stream_interval: int = 1
    """The workers' `--stream-interval` (tokens between a request's deltas)."""
    max_tokens: int = 64
    prompt_len: int = 16
    warmup_s: float = 1.0
    window_s: float = 3.0
    clients: int = 2
    """Client processes per level (fewer when there are fewer streams)."""
    ramp_timeout_s: float = 30.0
    """Longest wait for the workers to hold every stream before the warm-up starts anyway."""
    pd: bool = False
    api_workers: int = 1
    """API processes of the head (`--api-workers`); their CPU is the head's."""
    grpc_server: str = "h2"
    """The gateway's and the workers' gRPC servers (`deepinfer serve --grpc-server`)."""


class Cluster:
    def __init__(self, children: Children, workers: int, options: LoadOptions, max_concurrent: int):
        self.children = children
        self.options = options
        self.workers: dict[str, Child] = {}
        """Streaming workers (colocated, or decode with --pd) by worker id."""
        self.prefill: dict[str, Child] = {}
        head_args = ["--max-concurrent-requests", str(max_concurrent)] + (["--pd"] if options.pd else [])
        head_args += ["--api-workers", str(options.api_workers), "--grpc-server", options.grpc_server]
        self.head = children.start("head", "benchmarks.service_layer_head", head_args)
        info = self.head.expect(120.0)
        self.http_url, self.grpc_address = info["http_url"], info["grpc_address"]
        self.router_address = info["router_address"]
        self.api_pids: dict[str, int] = {f"{_API}{i + 1}": pid for i, pid in enumerate(info.get("api_pids", []))}
        self.cluster_token = info["cluster_token"]
        pools = [("decode" if options.pd else "colocated", f"w{i}") for i in range(workers)]
        pools += [("prefill", f"p{i}") for i in range(workers if options.pd else 0)]
        started = [(pool, wid, self._start_worker(pool, wid)) for pool, wid in pools]
        for pool, wid, child in started:
            child.expect(90.0)  # registered with the router
            (self.prefill if pool == "prefill" else self.workers)[wid] = child

    def _start_worker(self, pool: str, worker_id: str) -> Child:
        o = self.options
        args = ["--router", self.router_address, f"--cluster-token={self.cluster_token}"]  # a token may start with "-"
        args += ["--worker-id", worker_id, "--pool", pool]
        args += ["--step-ms", str(o.step_ms), "--tokens-per-step", str(o.tokens_per_step)]
        args += ["--stream-interval", str(o.stream_interval), "--grpc-server", o.grpc_server]
        return self.children.start(worker_id, "benchmarks.service_layer_worker", args)

    @property
    def all_workers(self) -> dict[str, Child]:
        return {**self.workers, **self.prefill}

    def pids(self) -> dict[str, int]:
        return {"head": self.head.pid, **self.api_pids, **{wid: c.pid for wid, c in self.all_workers.items()}}

    def idle_utilisation(self, seconds: float) -> dict[str, float]:
        """Share of one core each process uses with no request in flight (health polls, timers):
        the floor under every level's CPU per token, which dominates it at low token rates."""
        pids = self.pids()
        before = {name: cpu_times(pid) for name, pid in pids.items()}
        time.sleep(seconds)
        after = {name: cpu_times(pid) for name, pid in pids.items()}
        return fold_api_processes({name: cpu_delta(before[name], after[name]) / seconds for name in pids})

    def configure(self, step_period_s: float) -> None:
        for child in self.all_workers.values():
            child.ask({"cmd": "configure", "step_period_s": step_period_s})

    def wait_idle(self, timeout_s: float = 20.0) -> bool:
        """Until no worker holds a request (the aborts of cancelled streams have landed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(c.ask({"cmd": "stats"})["requests"] == 0 for c in self.all_workers.values()):
                return True
            time.sleep(0.1)
        return False

    def emissions(self, tmp_dir: str) -> Emissions:
        """Emission logs of the streaming workers since the last call."""
        result = Emissions()
        for wid, child in self.all_workers.items():
            path = os.path.join(tmp_dir, f"emissions-{wid}.json")
            child.ask({"cmd": "emissions", "path": path}, timeout_s=60.0)
            if wid in self.workers:
                with open(path) as f:
                    result.add(wid, json.load(f))
            os.remove(path)
        return result


def _start_clients(cluster: Cluster, protocol: str, streams: int, tmp_dir: str) -> list[tuple[Child, str]]:
    o = cluster.options
    n = max(1, min(o.clients, streams))
    target = cluster.http_url if protocol == "sse" else cluster.grpc_address
    clients, base = [], 0
    for i in range(n):
        share = streams // n + (1 if i < streams % n else 0)
        out = os.path.join(tmp_dir, f"client-{protocol}-{streams}-{i}.json")
        args = ["--protocol", protocol, "--target", target, "--streams", str(share), "--slot-base", str(base)]
        args += ["--max-tokens", str(o.max_tokens), "--prompt-len", str(o.prompt_len), "--name", f"c{i}"]
        args += ["--out", out]
        clients.append(
            (cluster.children.start(f"client-{protocol}-{streams}-{i}", "benchmarks.service_layer_client", args), out)
        )
        base += share
    for child, _ in clients:
        child.expect(60.0)
    return clients


def held_streams(cluster: Cluster) -> int:
    return sum(c.ask({"cmd": "stats"})["requests"] for c in cluster.workers.values())


def wait_ramp(cluster: Cluster, streams: int, timeout_s: float) -> bool:
    """Until the ramp, where the head admits each stream's first request, is over: the streaming
    workers hold (nearly) every stream, or what they hold has stopped growing (a saturated head
    keeps some streams between requests). False when the timeout came first."""
    deadline = time.monotonic() + timeout_s
    history: list[tuple[float, int]] = []
    while time.monotonic() < deadline:
        now, held = time.monotonic(), held_streams(cluster)
        if held >= 0.9 * streams:
            return True
        history.append((now, held))
        second_ago = [h for t, h in history if t <= now - 1.0]
        if held and second_ago and held - second_ago[-1] <= max(2, 0.02 * streams):
            return True
        time.sleep(0.1)
    return False


def _sample(cluster: Cluster, pids: dict[str, int]) -> dict[str, Any]:
    """CPU times of every process, and the token sources' own CPU seconds."""
    cpu = {name: cpu_times(pid) for name, pid in pids.items()}
    return {"cpu": cpu, "stats": {wid: c.ask({"cmd": "stats"}) for wid, c in cluster.all_workers.items()}}


def _cpu_in_window(cluster: Cluster, before: dict, after: dict, clients: list[Child]) -> dict[str, float]:
    """CPU seconds per process; for each worker also '<id> service': less its token source's own."""
    cpu = {name: cpu_delta(before["cpu"][name], after["cpu"][name]) for name in cluster.pids()}
    for wid in cluster.all_workers:
        cpu[f"{wid} service"] = cpu[wid] - (after["stats"][wid]["engine_cpu_s"] - before["stats"][wid]["engine_cpu_s"])
    cpu["clients"] = sum(cpu_delta(before["cpu"][c.name], after["cpu"][c.name]) for c in clients)
    return fold_api_processes(cpu)


def fold_api_processes(values: dict[str, float]) -> dict[str, float]:
    """The head's figure is every API process's together (`--api-workers`)."""
    out = {k: v for k, v in values.items() if not k.startswith(_API)}
    out["head"] = sum(v for k, v in values.items() if k == "head" or k.startswith(_API))
    return out


def _engine_batch(cluster: Cluster, before: dict, after: dict) -> Optional[float]:
    """Tokens per engine step over the window, across the streaming workers: the batch each
    step hands the service layer."""
    delta = {k: sum(after["stats"][w][k] - before["stats"][w][k] for w in cluster.workers) for k in ("tokens", "steps")}
    return delta["tokens"] / delta["steps"] if delta["steps"] else None


def run_level(cluster: Cluster, protocol: str, streams: int, tmp_dir: str) -> dict[str, Any]:
    o = cluster.options
    clients = _start_clients(cluster, protocol, streams, tmp_dir)
    started = time.monotonic()
    for child, _ in clients:
        child.send({"cmd": "go"})
    ramped = wait_ramp(cluster, streams, o.ramp_timeout_s)
    ramp_s = time.monotonic() - started
    time.sleep(o.warmup_s)
    held = held_streams(cluster)
    pids = {**cluster.pids(), **{child.name: child.pid for child, _ in clients}}
    window = Window(time.monotonic(), 0.0)
    before = _sample(cluster, pids)
    sleep_until(window.start + o.window_s)
    window.stop = time.monotonic()
    after = _sample(cluster, pids)
    records = []
    for child, _ in clients:
        child.send({"cmd": "stop"})
    for child, out in clients:
        child.expect(60.0)
        with open(out) as f:
            records += json.load(f)
        cluster.children.stop(child)
        os.remove(out)
    drained = cluster.wait_idle()
    cpu = _cpu_in_window(cluster, before, after, [c for c, _ in clients])
    numbers = level_numbers(records, cluster.emissions(tmp_dir), window, cpu, o.max_tokens, skip_first=o.pd)
    return {
        "protocol": protocol,
        "streams": streams,
        "ramp_s": ramp_s,
        "ramped": ramped,
        "streams_held_by_workers": held,
        "engine_batch": _engine_batch(cluster, before, after),
        "offered_tokens_per_s": streams * o.tokens_per_step * 1e3 / o.step_ms if o.step_ms > 0 else None,
        "drained": drained,
        **numbers,
    }
