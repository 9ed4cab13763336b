"""What a step samples for each sequence, and how each sampled token is taken in: the fan-out of
an n > 1 request at its first token, the token's text, and the stop rules that may end it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine import overlap
from deepinfer_core.engine.request_state import RequestState
from deepinfer_core.errors import FinishReason
from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.sampling.stop_checker import StopDecision, check_stop
from deepinfer_core.scheduler.outputs import SchedulerOutputs
from deepinfer_core.sequence import Sequence, SequenceStatus
from deepinfer_core.worker.model_runner import StepResult

if TYPE_CHECKING:
    from deepinfer_core.scheduler.scheduler import Scheduler


class SamplingRules:
    """Sampling rows in, tokens out; mixed into `LLMEngine`, whose state it uses."""

    config: EngineConfig
    tokenizer: Any
    scheduler: Scheduler
    requests: dict[str, RequestState]

    def _sampling_rows(self, out: SchedulerOutputs) -> list[list[SamplingRow]]:
        """Per scheduled sequence: no row (it samples nothing this step), one, or n (the first
        token of an n > 1 request, whose samples fork from one prefill)."""
        rows: list[list[SamplingRow]] = []
        for i, seq in enumerate(out.scheduled_seqs):
            if not out.samples(i):
                rows.append([])
                continue
            state = self.requests.get(seq.request_id)
            if overlap.needs_output_values(seq.params):  # penalties count token values
                assert not overlap.has_placeholder(seq), "penalised sampling needs the in-flight token (overlap.py)"
            fan_out = state is not None and seq.params.n > 1 and not state.forked
            gens = (
                state.generators if fan_out and state.generators else [seq.generator] * (seq.params.n if fan_out else 1)
            )
            rows.append(
                [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, g, seq.eos_token_id) for g in gens]
            )
        return rows

    def _take_samples(
        self, state: RequestState, seq: Sequence, result: StepResult, i: int, placeholder: bool = False
    ) -> None:
        """Append the step's samples of seq i; `placeholder`: its first sample replaces its placeholder."""
        tokens = result.token_ids[i]
        lps = result.logprobs[i] or [None] * len(tokens)
        tops = result.top_logprobs[i] or [None] * len(tokens)
        if result.consecutive:  # accepted drafts, then the target's token: one after another
            for token, lp, top in zip(tokens, lps, tops):
                if seq.is_finished:
                    break  # a stop rule ended it; the later tokens are never output
                self._append_token(state, seq, token, lp, top)
            return
        if len(tokens) > 1:  # first tokens of an n > 1 request: fork the other samples
            state.forked = True
            for k in range(1, len(tokens)):
                params = seq.params.clone()
                params.prompt_logprobs = None  # reported once, on the request
                child = self.scheduler.fork_seq(seq, sampling_params=params, index=k, output_token_ids=[])
                child.generator = state.generators[k] if state.generators else None
                state.seqs.append(child)
                state.add_detokenizer(self.tokenizer, child)
                self._append_token(state, child, tokens[k], lps[k], tops[k])
        self._append_token(state, seq, tokens[0], lps[0], tops[0], placeholder)

    def _append_token(self, state: RequestState, seq: Sequence, token: int, lp, top, placeholder: bool = False) -> None:
        """Take one sampled token (with its logprobs) into `seq`, stream its text, apply the stop rules."""
        if placeholder:
            overlap.resolve_placeholder(seq, token)
        else:
            seq.append_token(token)
        if lp is not None:
            seq.output_logprobs.append(lp)
            seq.output_top_logprobs.append(top)
        detok = state.detokenizers.get(seq.seq_id)
        delta = detok.add_tokens([token]) if detok is not None else ""
        seq.output_text += delta
        decision = check_stop(
            seq.params,
            seq.output_token_ids,
            seq.output_text,
            len(delta),
            seq.eos_token_id,
            seq.num_prompt_tokens,
            self.config.scheduler.max_model_len,
        )
        if decision.finished:
            self._finish_by_stop_rule(seq, decision, detok)

    def _finish_by_stop_rule(self, seq: Sequence, decision: StopDecision, detok) -> None:
        """The sequence's final text (a matched stop string cut off, else the held-back tail) and status."""
        if detok is not None and decision.truncate_text_to is None:
            seq.output_text += detok.flush()
        if decision.truncate_text_to is not None:
            seq.output_text = seq.output_text[: decision.truncate_text_to]
        seq.stop_reason = decision.stop_reason
        if seq.status == SequenceStatus.FINISHED_PREEMPTED:
            # Overlap only: KV ran out after this token was sampled; without overlap the token
            # would have ended the sequence first, so it is no preemption.
            seq.error = None
        stopped = decision.reason == FinishReason.STOP
        self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH)
