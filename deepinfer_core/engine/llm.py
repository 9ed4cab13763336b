"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Optional, Union

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]
"""A text, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}, a dict optionally
with "multi_modal_data": {"image": image or list of images} (one per image placeholder)."""


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs):
        """`model`: a Hugging Face model directory, or None for the embedded tiny model.
        Other keyword arguments are `EngineArgs` fields (dtype, max_model_len, block_size, ...)."""
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"offline-{next(self._ids)}"
                text, token_ids = _split_prompt(prompt)
                mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
                self.engine.add_request(rid, prompt=text, params=p, prompt_token_ids=token_ids, multi_modal_data=mm)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self, messages: list[dict], sampling_params: Optional[SamplingParams] = None, **kwargs
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation and generate. Image parts
        ({"type": "image", "image": ...} or {"type": "image_url", "image_url": {"url": ...}}) become
        the template's image placeholders and the request's images."""
        text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        images = _images_in(messages)
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        return self.generate([prompt], sampling_params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]


def _images_in(messages: list[dict]) -> list:
    """The images of a chat's content parts, in order."""
    images = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image":
                images.append(part["image"])
            elif part.get("type") == "image_url":
                url = part["image_url"]
                images.append(url["url"] if isinstance(url, dict) else url)
    return images


def _split_prompt(prompt: PromptType) -> tuple[Optional[str], Optional[list[int]]]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
