"""Decides, after each new token, whether a request is finished and why.

A pure function so the engine (and its tests) can call it with plain values.
The rules and their priority follow vLLM: EOS, then stop token ids, then stop
strings (none of them before `min_tokens` outputs), then the `max_tokens` and
context-length caps. The context cap applies even before `min_tokens`: the
request cannot grow past the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from deepinfer_core.errors import FinishReason
from deepinfer_core.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """Whether to finish a request after its latest token, in OpenAI/vLLM terms."""

    finished: bool
    reason: Optional[FinishReason]  # OpenAI finish_reason: STOP | LENGTH | None
    stop_reason: Optional[Union[int, str]]  # matched stop token id or stop string; None for EOS/length
    truncate_text_to: Optional[int]  # stop string matched: keep output_text[:truncate_text_to]


NOT_FINISHED = StopDecision(finished=False, reason=None, stop_reason=None, truncate_text_to=None)
_LENGTH = StopDecision(finished=True, reason=FinishReason.LENGTH, stop_reason=None, truncate_text_to=None)


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    output_text: str,
    new_text_len: int,
    eos_token_id: Optional[int],
    num_prompt_tokens: int,
    max_model_len: int,
) -> StopDecision:
    """Check the stop rules after the newest token (the last of `output_token_ids`).

    Args:
        params: the request's sampling parameters.
        output_token_ids: all output tokens, the newest last (EOS / stop tokens stay in it).
        output_text: the detokenized output so far, including the newest token's text.
        new_text_len: how many characters at the end of `output_text` the newest token added.
        eos_token_id: the tokenizer's EOS id, or None if it has none.
        num_prompt_tokens: prompt length in tokens.
        max_model_len: the model's context length in tokens.
    """
    num_output = len(output_token_ids)
    if num_output > 0 and num_output >= params.min_tokens:
        decision = _check_stop_token(params, output_token_ids[-1], eos_token_id) or _check_stop_strings(
            params, output_text, new_text_len
        )
        if decision is not None:
            return decision
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return _LENGTH
    if num_prompt_tokens + num_output >= max_model_len:
        return _LENGTH
    return NOT_FINISHED


def _check_stop_token(params: SamplingParams, token_id: int, eos_token_id: Optional[int]) -> Optional[StopDecision]:
    if not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id:
        return StopDecision(finished=True, reason=FinishReason.STOP, stop_reason=None, truncate_text_to=None)
    if token_id in (params.stop_token_ids or ()):
        return StopDecision(finished=True, reason=FinishReason.STOP, stop_reason=token_id, truncate_text_to=None)
    return None


def _check_stop_strings(params: SamplingParams, output_text: str, new_text_len: int) -> Optional[StopDecision]:
    """Find the earliest stop string that ends inside the newly added text."""
    if new_text_len <= 0 or not params.stop:
        return None
    best: Optional[tuple[int, str]] = None  # (match start, stop string)
    for stop_str in params.stop:
        # A new match ends in the last new_text_len chars, so it starts at or after this index.
        start = max(0, len(output_text) - new_text_len - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    cut = index + len(stop_str) if params.include_stop_str_in_output else index
    return StopDecision(finished=True, reason=FinishReason.STOP, stop_reason=stop_str, truncate_text_to=cut)
