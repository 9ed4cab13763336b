"""`SamplingParams` <-> its proto message. Unset proto fields take the dataclass defaults;
`max_tokens=None` (up to the context length) travels as 0."""

from __future__ import annotations

from dataclasses import fields

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_proto import common_pb2

_SCALARS = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
]
_LISTS = ["stop", "stop_token_ids"]
assert set(_SCALARS + _LISTS) <= {f.name for f in fields(SamplingParams)}


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for name in _SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.max_tokens is None:
        msg.max_tokens = 0
    msg.stop.extend(params.stop or [])
    msg.stop_token_ids.extend(params.stop_token_ids or [])
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) for values SamplingParams rejects."""
    kwargs = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if kwargs.get("max_tokens") == 0:
        kwargs["max_tokens"] = None
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**kwargs)
