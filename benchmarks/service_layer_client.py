"""A load-generating client process of the service-layer benchmark (kept apart from the head, so
that its CPU is not counted there).

    python -m benchmarks.service_layer_client --protocol sse|grpc --target URL|HOST:PORT --streams K --out FILE

It holds K streams open: each slot runs streamed completions back to back, SSE over its own
keep-alive HTTP connection or `deepinfer.v1.Gateway/Generate` on one shared gRPC channel. It
prints {"ready": true}, starts on {"cmd": "go"} (stdin), cancels what is still open on
{"cmd": "stop"}, writes every request it made to FILE (`RequestRecord`s as JSON) and prints
{"done": true}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from benchmarks.service_layer_procs import commands, prepare_child, reply
from benchmarks.service_layer_sse import HttpConnection
from benchmarks.token_source import VOCAB_SIZE, ids_of_text


@dataclass
class RequestRecord:
    """What one client request got; `recv[j]` is the monotonic time token j arrived."""

    slot: int
    seed: int
    """The prompt's first id: it fixes the tokens the source emits (`token_source.token_id`)."""
    request_id: str = ""
    """The gateway's id (the worker holds it as `<id>-0/0`)."""
    tokens: list[int] = field(default_factory=list)
    recv: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    error_at: Optional[float] = None
    """Monotonic time the error arrived."""
    in_order: bool = True
    """Every delta started where the previous one ended (gRPC carries offsets; SSE does not)."""

    def add(self, ids: list[int], now: float) -> None:
        self.tokens += ids
        self.recv += [now] * len(ids)


def prompt_of(seed: int, prompt_len: int) -> list[int]:
    return [seed] + [1 + i % 500 for i in range(prompt_len - 1)]


class Load:
    """K slots of back-to-back requests; `records` gathers every request started."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[RequestRecord] = []
        self._grpc_stub = None

    def new_record(self, slot: int, k: int) -> RequestRecord:
        seed = (self.args.slot_base + slot) * 37 + k * 11
        record = RequestRecord(slot, seed % VOCAB_SIZE)
        self.records.append(record)
        return record

    async def run_slot(self, slot: int) -> None:
        conn = HttpConnection(self.args.target) if self.args.protocol == "sse" else None
        try:
            for k in range(1 << 30):
                record = self.new_record(slot, k)
                try:
                    if conn is not None:
                        await self.sse_request(conn, record)
                    else:
                        await self.grpc_request(record, f"{self.args.name}-{slot}-{k}")
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # recorded (the run reports it); the slot goes on
                    record.error, record.error_at = f"{type(e).__name__}: {e}", time.monotonic()
                    if conn is not None:
                        conn.close()
                    await asyncio.sleep(0.05)
        finally:
            if conn is not None:
                conn.close()  # the gateway sees the client go and aborts what is open

    async def sse_request(self, conn: HttpConnection, record: RequestRecord) -> None:
        body = {"prompt": prompt_of(record.seed, self.args.prompt_len), "max_tokens": self.args.max_tokens}
        body["stream"] = True

        def on_event(obj: dict) -> None:
            now = time.monotonic()
            if "error" in obj:
                record.error, record.error_at = obj["error"].get("message", "error"), now
                return
            record.request_id = record.request_id or obj["id"]
            choice = obj["choices"][0]
            record.add(ids_of_text(choice["text"]), now)
            record.finish_reason = choice["finish_reason"] or record.finish_reason

        await conn.stream_events("/v1/completions", body, on_event)

    async def grpc_request(self, record: RequestRecord, request_id: str) -> None:
        from deepinfer_proto import common_pb2, gateway_pb2

        record.request_id = request_id
        request = gateway_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=gateway_pb2.TokenIds(ids=prompt_of(record.seed, self.args.prompt_len)),
            params=common_pb2.SamplingParams(max_tokens=self.args.max_tokens),
        )
        call = self._grpc_stub.Generate(request)
        try:
            async for msg in call:
                if not msg.HasField("delta"):
                    continue  # the closing message with usage
                now, delta = time.monotonic(), msg.delta
                record.in_order &= delta.token_offset == len(record.tokens)
                record.add(list(delta.token_ids), now)
                record.finish_reason = delta.finish_reason or record.finish_reason
        finally:
            call.cancel()

    async def run(self, stopped: asyncio.Future) -> None:
        """Every slot until `stopped` resolves; then cancel what is open."""
        tasks = [asyncio.ensure_future(self.run_slot(s)) for s in range(self.args.streams)]
        await stopped
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def main_async(args: argparse.Namespace) -> None:
    load = Load(args)
    channel = None
    if args.protocol == "grpc":
        from deepinfer_proto import gateway_pb2_grpc
        from services.common.grpc_util import channel as grpc_channel

        channel = grpc_channel(args.target)
        await asyncio.wait_for(channel.channel_ready(), 30)
        load._grpc_stub = gateway_pb2_grpc.GatewayStub(channel)
    reply({"ready": True})
    loop = asyncio.get_running_loop()
    orders = commands()
    go = await loop.run_in_executor(None, next, orders, None)
    if go is None or go.get("cmd") != "go":
        return
    # the next command (or stdin closing) is the stop
    await load.run(loop.run_in_executor(None, next, orders, None))
    if channel is not None:
        await channel.close()
    with open(args.out, "w") as f:
        json.dump([asdict(r) for r in load.records], f)
    reply({"done": True, "requests": len(load.records)})


def main() -> None:
    prepare_child()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=("sse", "grpc"), required=True)
    parser.add_argument("--target", required=True, help="the gateway's http://host:port (sse) or host:port (grpc)")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--slot-base", type=int, default=0, help="this client's first slot number (seeds differ)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--name", default="client")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from services.common.grpc_util import install_uvloop

    install_uvloop()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
