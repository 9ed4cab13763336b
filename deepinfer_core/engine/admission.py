"""Admission: a request's prompt, images and sampling parameters checked and turned into its
first `Sequence` and `RequestState`.

Every refusal is the client's to fix and raises `InvalidRequestError` before anything is queued
or allocated, so nothing has to be rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from deepinfer_core import envs
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.request_state import RequestState
from deepinfer_core.errors import InvalidRequestError
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence

if TYPE_CHECKING:
    from deepinfer_core.multimodal.processor import MultiModalProcessor
    from deepinfer_core.scheduler.scheduler import Scheduler
    from deepinfer_core.worker.worker import Worker


class RequestAdmission:
    """`LLMEngine.add_request` and its checks; mixed into `LLMEngine`, whose state it uses."""

    config: EngineConfig
    name: str
    tokenizer: Any
    worker: Worker
    scheduler: Scheduler
    mm_processor: Optional[MultiModalProcessor]
    requests: dict[str, RequestState]
    _seq_ids: Iterator[int]

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str] = None,
        params: Optional[SamplingParams] = None,
        prompt_token_ids: Optional[list[int]] = None,
        arrival_time: Optional[float] = None,
        enqueue: bool = True,
        multi_modal_data: Optional[dict] = None,
        resumed_tokens: int = 0,
        computes_prompt: Optional[bool] = None,
    ) -> Sequence:
        """Admit a request. With `enqueue=False` the sequence is built but not queued
        (a CE enqueues it once its KV has arrived; rejecting before that needs no rollback).
        `multi_modal_data`: {"image": image(s)} or {"image_embeds": ...}, one per placeholder token.
        `resumed_tokens`: the prompt's last this many tokens are output of an earlier attempt (a
        migrated sample's continuation). They are plain tokens: an image placeholder id among them
        is a token the model generated, not a place for an image.
        `computes_prompt`: this engine runs the prompt's forward (default: when it enqueues; a CE's
        local prefill does, later): a prompt it computes has its image placeholders checked.

        Raises:
            InvalidRequestError: a used request id, an empty, over-long or out-of-vocabulary prompt,
                or images this engine cannot take or that do not match the prompt's placeholders.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if not 0 <= resumed_tokens < len(ids):
            raise InvalidRequestError(
                f"resumed_tokens={resumed_tokens} must leave at least one of the prompt's {len(ids)} tokens"
            )
        head, resumed = ids[: len(ids) - resumed_tokens], ids[len(ids) - resumed_tokens :]
        computes_prompt = enqueue if computes_prompt is None else computes_prompt
        ids, images = self._image_inputs(head, multi_modal_data, computes_prompt=computes_prompt)
        ids = ids + resumed
        limit = self.config.scheduler.max_model_len
        if images and len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens with its images expanded; max_model_len is {limit}"
            )
        params = _resolve_params(params, self.config.scheduler.max_model_len - len(ids))
        seq = Sequence(next(self._seq_ids), request_id, ids, params, eos_token_id=self._eos_id())
        seq.mm_placeholders = images
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        state = RequestState(request_id, prompt, ids, params, seqs=[seq])
        if params.seed is not None:
            state.generators = [_generator(params.seed + i, self.worker.device) for i in range(params.n)]
            seq.generator = state.generators[0]
        state.add_detokenizer(self.tokenizer, seq)
        self.requests[request_id] = state
        if enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def _prompt_ids(self, prompt: Optional[str], prompt_token_ids: Optional[list[int]]) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = int(self.config.model.hf_config["vocab_size"])
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {limit} (prompt + at least one output token)"
            )
        return ids

    def _build_mm_processor(self) -> Optional[MultiModalProcessor]:
        """The image processor of a multimodal model; none on roles without a multimodal pool."""
        if not envs.DEEPINFER_USE_MULTIMODAL_POOL or not hasattr(self.worker.model, "encode_images"):
            return None
        from deepinfer_core.multimodal.processor import MultiModalProcessor

        return MultiModalProcessor.for_model(self.worker.model, self.config.model.path, self.worker.device)

    def _image_inputs(
        self, ids: list[int], multi_modal_data: Optional[dict], computes_prompt: bool
    ) -> tuple[list[int], list]:
        """(prompt ids with image placeholders expanded, the images bound to their positions).
        A sequence whose prompt KV arrives from elsewhere (`computes_prompt=False`) needs no images."""
        if self.mm_processor is None:
            if multi_modal_data:
                raise InvalidRequestError(
                    f"engine {self.name} takes no images (text-only model, or no multimodal pool)"
                )
            return ids, []
        if not multi_modal_data:
            if computes_prompt:
                self.mm_processor.check_text_only(ids)
            return ids, []
        return self.mm_processor.process(ids, multi_modal_data)

    def _eos_id(self) -> Optional[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = self.config.model.hf_config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos


def _resolve_params(params: SamplingParams, room: int) -> SamplingParams:
    """A request's own parameters: `max_tokens` defaults to the `room` the context leaves after the
    prompt (a larger one is kept; the stop rules' context cap ends the request there)."""
    if params.max_tokens is None or params.max_tokens > room:
        params = params.clone()
        params.max_tokens = room if params.max_tokens is None else params.max_tokens
    return params


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
