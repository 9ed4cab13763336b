"""Run engines in separate OS processes and drive requests through reserve -> prefill ->
transfer -> decode, as deployed (transfers between processes, never inside one).

`EngineProcess` hosts one engine behind a pipe; its loop applies commands between steps,
polls hand-off notices (CE) and steps while there is work. `PDPair` wires one PE to one
CE. The cluster services wrap the same engine calls in gRPC. Tests and benchmarks use it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from deepinfer_core.errors import FinishReason
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.roles import EngineType, engine_class
from deepinfer_core.sampling_params import SamplingParams


class RemoteError(RuntimeError):
    """An engine process raised; `kind` is the exception's class name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class EngineProcess:
    def __init__(self, engine_type: EngineType, engine_args: dict[str, Any], start_timeout_s: float = 300.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.engine_type = engine_type
        self.proc = ctx.Process(target=_serve, args=(child, engine_type, engine_args), daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"{engine_type.name} engine process did not start in {start_timeout_s}s")
        status, info = self._conn.recv()
        if status != "ready":
            self.proc.join(5)
            raise RemoteError(*info)
        self.info: dict[str, Any] = info

    def call(self, method: str, *args, timeout_s: float = 120.0, **kwargs):
        self._conn.send((method, args, kwargs))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.engine_type.name} engine did not answer {method!r} in {timeout_s}s")
        status, value = self._conn.recv()
        if status == "error":
            raise RemoteError(*value)
        return value

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.alive:
            try:
                self.call("shutdown", timeout_s=30)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
            self.proc.join(10)
            if self.alive:
                self.kill()


# ---- the engine side ------------------------------------------------------------------------
def _build(engine_type: EngineType, engine_args: dict[str, Any]):
    from deepinfer_core.engine_args import EngineArgs

    return engine_class(engine_type).from_engine_args(EngineArgs(engine_type=engine_type, **engine_args))


class _Server:
    def __init__(self, engine):
        self.engine = engine
        self.outbox: list[RequestOutput] = []

    def reserve(self, request_id, params, prompt_token_ids, lease_s=30.0):
        return self.engine.reserve(request_id, params, prompt_token_ids, lease_s=lease_s).to_bytes()

    def add_prefill(self, request_id, target_bytes, params, prompt_token_ids, multi_modal_data=None):
        from deepinfer_core.transfer.messages import KVTarget

        target = KVTarget.from_bytes(target_bytes)
        self.engine.add_prefill(request_id, target, params, prompt_token_ids, multi_modal_data=multi_modal_data)

    def add_request(self, request_id, params, prompt_token_ids):
        self.engine.add_request(request_id, params=params, prompt_token_ids=prompt_token_ids)

    def connect_peer(self, name, metadata, region=None):
        self.engine.connect_peer(name, metadata, region)

    def abort(self, request_id):
        self.engine.abort_request(request_id)

    def renew_reservation(self, request_id, lease_s):
        """CE: a heartbeat for a reservation; its new end (wall clock), 0.0 when not waiting."""
        return self.engine.renew_reservation(request_id, lease_s)

    def release_unused(self, request_id):
        """CE: end a reservation no PE was given (its blocks are free at once)."""
        self.engine.release_unused(request_id)

    def collect(self):
        outputs, self.outbox = self.outbox, []
        return outputs, self.engine.pop_handoff_results()

    def stats(self):
        sched, agent = self.engine.scheduler, self.engine.agent
        return {
            "free_blocks": sched.block_manager.num_free_blocks,
            "num_blocks": sched.block_manager.num_blocks,
            "waiting": len(sched.waiting),
            "prompted": len(sched.prompted),
            "running": len(sched.running),
            "requests": len(self.engine.requests),
            "reservations": len(getattr(self.engine, "reservations", {})),
            "quarantined": len(getattr(self.engine, "quarantine", {})),
            "handoffs": getattr(self.engine, "num_handoffs", 0),
            "prefix_hit_tokens": sched.block_manager.prefix_hits,
            "lease_expiries": getattr(self.engine, "num_lease_expiries", 0),
            "remote_lists": agent.num_remote_lists if agent is not None else 0,
            "progress_thread": agent.progress_thread if agent is not None else None,
            "computed_prompt_tokens": getattr(self.engine, "num_computed_prompt_tokens", 0),
            "loading": len(sched.loading),
            "kv_store": self.kv_store_stats(),
            "spec_draft_tokens": self.engine.load().spec_draft_tokens,
            "spec_accepted_tokens": self.engine.load().spec_accepted_tokens,
        }

    def kv_store_stats(self):
        """The engine's KV store counters as a dict (None without a store)."""
        stats = self.engine.kv_store_stats() if hasattr(self.engine, "kv_store_stats") else None
        return stats.to_dict() if stats is not None else None

    def kv_store_paths(self, prompt_token_ids):
        """The entry of each full block of a text prompt, in order: its file's path, or its object's
        key in a bucket store."""
        from deepinfer_core.sequence import Sequence

        store = self.engine.kv_store
        seq = Sequence(-1, "", list(prompt_token_ids), SamplingParams())
        name_of = store.tier.bucket.object_key if hasattr(store.tier, "bucket") else store.tier.path_of
        return [name_of(k) for k in store.keys(seq, len(seq) // store.block_size)]

    def pump(self) -> bool:
        """One loop turn of engine work; True when there was work."""
        outs = self.engine.poll_handoffs()
        self.outbox.extend(outs)
        worked = bool(outs)
        if self.engine.has_unfinished_requests():
            self.outbox.extend(self.engine.step())
            worked = True
        return worked


def _serve(conn, engine_type: EngineType, engine_args: dict[str, Any]) -> None:
    try:
        engine = _build(engine_type, dict(engine_args))
    except Exception as e:
        conn.send(("failed", (type(e).__name__, f"{e}\n{traceback.format_exc()}")))
        return
    server = _Server(engine)
    agent = engine.agent
    conn.send(
        (
            "ready",
            {
                "name": engine.name,
                "agent_name": agent.name if agent else None,
                "agent_metadata": agent.metadata if agent else None,
                "kv_region": agent.region if agent else None,
            },
        )
    )
    busy = False
    while True:
        # One call (callers wait for each reply), then one turn of engine work: a caller that
        # polls in a tight loop must not keep the engine from its next step.
        if conn.poll(0 if busy else 0.002):
            method, args, kwargs = conn.recv()
            if method == "shutdown":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(server, method)(*args, **kwargs)))
            except Exception as e:
                conn.send(("error", (type(e).__name__, str(e))))
        busy = server.pump()


# ---- the driver side ------------------------------------------------------------------------
@dataclass
class PDPair:
    """One PE and one CE in two processes; `generate` runs requests end to end."""

    engine_args: dict[str, Any]
    pe_args: dict[str, Any] = field(default_factory=dict)
    ce_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.ce = EngineProcess(
            EngineType.COMPLETION, {**self.engine_args, "stop_preempted_request": True, **self.ce_args}
        )
        self.pe = self._start_pe()
        self._ids = 0

    def _start_pe(self) -> EngineProcess:
        pe = EngineProcess(EngineType.PROMPT, {**self.engine_args, **self.pe_args})
        pe.call("connect_peer", self.ce.info["agent_name"], self.ce.info["agent_metadata"], self.ce.info["kv_region"])
        return pe

    def restart_pe(self, **pe_args) -> None:
        """Replace the PE with a fresh process (empty prefix cache and host pool), `pe_args` updated."""
        self.pe.close()
        self.pe_args = {**self.pe_args, **pe_args}
        self.pe = self._start_pe()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lease_s: float = 30.0,
        multi_modal_data: Optional[dict] = None,
    ):
        """`multi_modal_data`: the PE's images; `prompt_token_ids` then has each placeholder expanded."""
        target = self.ce.call("reserve", request_id, params, prompt_token_ids, lease_s)
        self.pe.call("add_prefill", request_id, target, params, prompt_token_ids, multi_modal_data)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 300.0, lease_s: float = 30.0
    ) -> list[RequestOutput]:
        ids = []
        for p in prompts:
            rid = f"pd-{self._ids}"
            self._ids += 1
            self.submit(rid, p, params, lease_s)
            ids.append(rid)
        return self.wait(ids, timeout_s)

    def wait(self, ids: list[str], timeout_s: float = 300.0) -> list[RequestOutput]:
        """Collect until every id has a final output (from the CE, or a failed hand-off from the PE)."""
        done: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ids):
            if time.monotonic() > deadline:
                missing = [i for i in ids if i not in done]
                raise TimeoutError(f"{len(missing)} requests unfinished: {missing[:5]}")
            outs, _ = self.ce.call("collect") if self.ce.alive else ([], [])
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
            _, results = self.pe.call("collect")
            for r in results:
                if not r.ok and r.request_id not in done:
                    done[r.request_id] = _failed_output(r.request_id, r.error)
            time.sleep(0.002)
        return [done[i] for i in ids]

    def close(self) -> None:
        self.pe.close()
        self.ce.close()


def _failed_output(request_id: str, error: Optional[str]) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=FinishReason.ERROR, error=error)],
        finished=True,
    )
