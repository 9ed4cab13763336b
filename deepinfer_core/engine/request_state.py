"""Per-request bookkeeping of the engine: its samples, detokenizers and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    """The request's samples; index 0 is created at admission, the rest fork after prefill."""
    generators: list[Optional[torch.Generator]] = field(default_factory=list)
    """One RNG per sample when the request has a seed (sample i uses seed + i)."""
    detokenizers: dict[int, object] = field(default_factory=dict)
    """seq_id -> IncrementalDetokenizer."""
    forked: bool = False
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    def add_detokenizer(self, tokenizer, seq: Sequence) -> None:
        """Stream `seq`'s text as its tokens come (none without a tokenizer or when not asked)."""
        if tokenizer is None or not seq.params.detokenize:
            return
        from deepinfer_core.detokenizer import IncrementalDetokenizer

        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )

    @property
    def finished(self) -> bool:
        complete = self.forked or self.params.n == 1 or self.seqs[0].is_finished
        return complete and all(s.is_finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        outs = [_completion(s) for s in sorted(self.seqs, key=lambda s: s.index)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.seqs[0].num_prefix_hit_tokens,
        )


def _completion(seq: Sequence) -> CompletionOutput:
    logprobs = None
    cumulative = None
    if seq.params.logprobs is not None:
        logprobs = [d if d is not None else {} for d in seq.output_top_logprobs]
        cumulative = float(sum(seq.output_logprobs))
    return CompletionOutput(
        index=seq.index,
        text=seq.output_text,
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
        error=seq.error,
    )
