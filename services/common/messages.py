"""Proto forms of the typed messages in `deltas.py`, `workers.py` and `prefill_result.py`, and of
the KV transfer's `KVRegion` and `KVTarget`."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Optional

from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from deepinfer_core.transfer.messages import KVRegion, KVTarget
from deepinfer_proto import common_pb2, worker_pb2
from services.common.deltas import SampleDelta, TokenLogprob
from services.common.prefill_result import PrefillResult
from services.common.workers import WorkerInfo, WorkerLoad
from services.native import encode_batch


def delta_to_proto(d: SampleDelta) -> common_pb2.SampleDelta:
    return fill_delta(common_pb2.SampleDelta(), d)


def fill_delta(msg: common_pb2.SampleDelta, d: SampleDelta) -> common_pb2.SampleDelta:
    """Write `d` into an empty `msg` (a batch's own submessage: no copy). Fields at their default
    are left unset: a running delta's one token and its text are most of the token path."""
    if d.index:
        msg.index = d.index
    msg.token_offset = d.token_offset
    if d.token_ids:
        msg.token_ids.extend(d.token_ids)
    msg.text_offset = d.text_offset
    if d.text:
        msg.text = d.text
    if d.logprobs:
        for lp in d.logprobs:
            msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
    if d.finish_reason:
        msg.finish_reason = d.finish_reason
    if d.stop_reason is not None:
        if isinstance(d.stop_reason, int):
            msg.stop_token_id = d.stop_reason
        else:
            msg.stop_string = d.stop_reason
    if d.error:
        msg.error = d.error
    if d.num_cached_tokens:
        msg.num_cached_tokens = d.num_cached_tokens
    return msg


def delta_from_proto(msg: common_pb2.SampleDelta) -> SampleDelta:
    # built in one call: this runs once per token on the router
    lps = msg.logprobs
    which = msg.WhichOneof("stop_reason")
    return SampleDelta(
        msg.index,
        msg.token_offset,
        list(msg.token_ids),
        msg.text_offset,
        msg.text,
        [TokenLogprob(lp.token_id, lp.logprob, dict(lp.top)) for lp in lps] if lps else None,
        msg.finish_reason or None,
        getattr(msg, which) if which else None,
        msg.error or None,
        msg.num_cached_tokens,
    )


def batch_to_proto(items: list[tuple[str, SampleDelta]]) -> worker_pb2.DeltaBatch:
    """(request id, delta) pairs, in order, as one message of a worker's subscription."""
    batch = worker_pb2.DeltaBatch()
    add = batch.items.add
    for request_id, delta in items:
        fill_delta(add(request_id=request_id).delta, delta)
    return batch


def batch_message(items: list[tuple[str, SampleDelta]]) -> worker_pb2.DeltaBatch:
    """`batch_to_proto(items)`, encoded in compiled code where it is built (`services.native`) and
    parsed back by protobuf's own C: a fifth of the CPU of filling the message from Python."""
    raw = encode_batch(items) if encode_batch is not None else None
    return worker_pb2.DeltaBatch.FromString(raw) if raw is not None else batch_to_proto(items)


def region_to_proto(region: Optional[KVRegion]) -> Optional[common_pb2.KVRegion]:
    return None if region is None else common_pb2.KVRegion(**asdict(region))


def region_from_proto(parent, name: str) -> Optional[KVRegion]:
    """The KVRegion in message field `parent.<name>`, None where the sender left it out."""
    if not parent.HasField(name):
        return None
    msg = getattr(parent, name)
    return KVRegion(**{f.name: getattr(msg, f.name) for f in fields(KVRegion)})


def target_to_proto(target: KVTarget) -> common_pb2.KVTarget:
    return common_pb2.KVTarget(**asdict(target))


def target_from_proto(msg: common_pb2.KVTarget) -> KVTarget:
    values = {f.name: getattr(msg, f.name) for f in fields(KVTarget)}
    return KVTarget(**{**values, "block_ids": list(msg.block_ids)})


def prefill_result_to_proto(r: PrefillResult) -> worker_pb2.PrefillReply:
    return worker_pb2.PrefillReply(
        first=delta_to_proto(r.first),
        kv_bytes=r.kv_bytes,
        kv_seconds=r.kv_seconds,
        queue_seconds=r.queue_seconds,
        kv_exposed_seconds=r.kv_exposed_seconds,
        embeds_seconds=r.embeds_seconds,
    )


def prefill_result_from_proto(msg: worker_pb2.PrefillReply) -> PrefillResult:
    return PrefillResult(
        delta_from_proto(msg.first),
        msg.kv_bytes,
        msg.kv_seconds,
        msg.queue_seconds,
        msg.kv_exposed_seconds,
        msg.embeds_seconds,
    )


def info_to_proto(info: WorkerInfo) -> common_pb2.WorkerInfo:
    plain = {f.name: getattr(info, f.name) for f in fields(WorkerInfo) if f.name != "kv_region"}
    return common_pb2.WorkerInfo(**plain, kv_region=region_to_proto(info.kv_region))


def info_from_proto(msg: common_pb2.WorkerInfo) -> WorkerInfo:
    plain = {f.name: getattr(msg, f.name) for f in fields(WorkerInfo) if f.name != "kv_region"}
    return WorkerInfo(**plain, kv_region=region_from_proto(msg, "kv_region"))


def load_to_proto(load: WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(**{f.name: getattr(load, f.name) for f in fields(WorkerLoad)})


def load_from_proto(msg: common_pb2.WorkerLoad) -> WorkerLoad:
    values = {f.name: getattr(msg, f.name) for f in fields(WorkerLoad)}
    return WorkerLoad(**{k: list(v) if hasattr(v, "extend") else v for k, v in values.items()})  # repeated -> list


def handle_to_proto(h: EmbeddingHandle) -> worker_pb2.EmbeddingHandle:
    return worker_pb2.EmbeddingHandle(**{**asdict(h), "shape": list(h.shape)})


def handle_from_proto(msg: worker_pb2.EmbeddingHandle) -> EmbeddingHandle:
    values = {f.name: getattr(msg, f.name) for f in fields(EmbeddingHandle)}
    return EmbeddingHandle(**{**values, "shape": tuple(msg.shape)})
