"""A stream continued from migration's clean point spells the text of an undisturbed one, wherever
the engine died: also inside a character whose bytes are split across tokens, and among invalid
bytes (the router's `SampleProgress` against the engine's real `IncrementalDetokenizer`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer_core.builtin import make_tokenizer
from deepinfer_core.detokenizer import IncrementalDetokenizer
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.tokenizer import Tokenizer, load_tokenizer
from services.common.deltas import SampleAssembler, SampleDelta
from services.router.migration import SampleProgress

TINY_DIR = Path(make_tokenizer.__file__).parent / "tiny"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(TINY_DIR)


def _attempt(tok, progress: SampleProgress, client: SampleAssembler, prompt, ids: list[int], finish: bool) -> None:
    """One engine's stream of `ids` after `prompt`, one token a step, each delta placed by `progress`
    and applied to what the client holds (`client`), as the router's assembler does."""
    detok = IncrementalDetokenizer(tok, prompt)
    chars = 0
    for i, token in enumerate(ids):
        text = detok.add_tokens([token])
        if finish and i == len(ids) - 1:
            text += detok.flush()
        client.apply(progress.place(SampleDelta(0, i, [token], chars, text)))
        chars += len(text)


def _migrated_text(tok: Tokenizer, prompt: list[int], ids: list[int], killed_after: int) -> str:
    progress = SampleProgress(prompt, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    client = SampleAssembler(0)
    _attempt(tok, progress, client, prompt, ids[:killed_after], finish=False)
    new_prompt, _ = progress.continuation()
    n = len(new_prompt) - len(prompt)
    assert new_prompt == prompt + ids[:n]  # made again from the clean point on
    _attempt(tok, progress, client, new_prompt, ids[n:], finish=True)
    assert progress.num_tokens == len(ids) and client.tokens == ids
    return client.text


def test_a_stream_killed_at_any_token_continues_with_the_undisturbed_text(tok: Tokenizer) -> None:
    prompt = tok.encode("story: ")
    ids = tok.encode("ab 😀 cd 🦀🦀 ef 天天 gh é")
    want = tok.decode(ids)
    for k in range(1, len(ids)):
        assert _migrated_text(tok, prompt, ids, k) == want, k


def test_random_tokens_with_invalid_bytes_continue_with_the_undisturbed_text(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(60):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 6))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(2, 30))]
        for k in range(1, len(ids)):
            assert _migrated_text(tok, prompt, ids, k) == tok.decode(ids), (prompt, ids, k)
