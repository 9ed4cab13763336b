"""Incremental detokenization: no split characters, same text as a full decode, bounded window."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from deepinfer_core.builtin import make_tokenizer
from deepinfer_core.detokenizer import IncrementalDetokenizer
from deepinfer_core.tokenizer import Tokenizer, load_tokenizer

TINY_DIR = Path(make_tokenizer.__file__).parent / "tiny"
SENTENCEPIECE_PIECES = ["▁", "a", "c", "t", "é", "天"]
TEXTS = [
    "Hello 😀👍🏽 world 👨‍👩‍👧‍👦!",
    "今天天气很好，我们去公园散步吧。東京は日本の首都です。안녕하세요",
    "combining e\u0301 a\u0308\u0323 and Z\u0351\u0352\u0353 marks",
    'code: for (i = 0; i < 10; i++) {\n\tprintf("%d\\n", i);\n}   ',
    "mixed 🇫🇷 ünïcödé € 100 ≤ 200 𝔘𝔫𝔦𝔠𝔬𝔡𝔢<|im_end|> after the stop",
]
PROMPTS = ["", "Translate: 天"]
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(TINY_DIR)


@pytest.fixture(scope="module")
def sentencepiece_like(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Llama-2 style: "▁" for spaces, <0xNN> byte fallback, the first leading space stripped."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), *SENTENCEPIECE_PIECES]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    root = tmp_path_factory.mktemp("sentencepiece_like")
    backend.save(str(root / "tokenizer.json"))
    return load_tokenizer(root)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


def test_texts_contain_characters_split_across_tokens(tok: Tokenizer) -> None:
    # Without such characters the streaming tests below would prove nothing.
    non_ascii = [t for t in TEXTS if not t.isascii()]
    split = [t for t in non_ascii if any(FFFD in tok.decode([i]) for i in tok.encode(t))]
    assert split == non_ascii


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_one_token_at_a_time(tok: Tokenizer, text: str, prompt: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), skip_special_tokens)
    deltas = _stream(detok, ids)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens) == detok.output_text


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_per_step(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode("".join(TEXTS))
    deltas = _stream(IncrementalDetokenizer(tok, tok.encode(PROMPTS[1])), ids, chunk)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|><|pad|>b")
    assert "".join(_stream(IncrementalDetokenizer(tok, [], True), ids)) == "ab"
    kept = "".join(_stream(IncrementalDetokenizer(tok, [], False), ids))
    assert kept == "a<|im_end|><|pad|>b"


def test_text_is_released_as_soon_as_a_character_completes(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert [detok.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("🦀🦀")
    split = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(FFFD))
    prompt, output = tok.encode("p") + ids[:split], ids[split:]
    deltas = _stream(IncrementalDetokenizer(tok, prompt), output)
    assert "".join(deltas) == tok.decode(output)


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_released_at_every_character_boundary_and_only_there(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPTS[1]))
    released = ""
    for n in range(1, len(ids) + 1):
        detok.add_tokens(ids[n - 1 : n])
        full = tok.decode(ids[:n])
        if not full.endswith(FFFD):
            released = full  # on a boundary: everything so far is out
        assert detok.output_text == released  # inside a character: nothing new, not even text before it


def test_a_token_ending_inside_a_character_holds_its_whole_text(tok: Tokenizer) -> None:
    """The text so far is always the decoding of the tokens up to a character boundary: the step
    that leaves a character unfinished releases none of its text (migration continues a stream
    from a step with text, taking the tokens so far as its prompt)."""
    ids = tok.encode("ab 😀 cd 🦀🦀 ef 天天")
    cases = 0
    for n in range(1, len(ids)):
        before, after = tok.decode(ids[: n - 1]), tok.decode(ids[:n])
        if after.endswith(FFFD) and len(after.rstrip(FFFD)) > len(before.rstrip(FFFD)):
            cases += 1  # this token brings whole characters and starts an unfinished one
            detok = IncrementalDetokenizer(tok, [])
            released = "".join(detok.add_tokens([i]) for i in ids[: n - 1])
            assert detok.add_tokens([ids[n - 1]]) == ""
            assert detok.output_text == released
    assert cases > 0, "the text should have a token that ends inside a character after whole ones"


def test_random_ids_match_full_decode(tok: Tokenizer) -> None:
    # Random ids include invalid UTF-8: the stream must still spell the same U+FFFDs.
    rng = random.Random(0)
    for _ in range(300):
        output = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        skip = rng.random() < 0.5
        deltas = _stream(IncrementalDetokenizer(tok, prompt, skip), output, rng.randint(1, 3))
        assert "".join(deltas) == tok.decode(output, skip), (prompt, output, skip)


def test_out_of_vocabulary_ids_are_ignored(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens([tok.vocab_size + 5]) == ""
    assert detok.add_tokens(tok.encode("ok")) == "ok"


class _WindowSpy:
    """Records the longest id list the detokenizer asks the tokenizer to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest = tok, 0
        self.vocab_size, self.all_special_ids = tok.vocab_size, tok.all_special_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def test_window_stays_small_on_long_output(tok: Tokenizer) -> None:
    ids = tok.encode("\n".join(make_tokenizer.CORPUS) * 3)
    assert len(ids) > 5000
    spy = _WindowSpy(tok)
    deltas = _stream(IncrementalDetokenizer(spy, tok.encode("prompt")), ids)  # type: ignore[arg-type]
    assert "".join(deltas) == tok.decode(ids)
    assert spy.longest <= 24  # a few tokens of context plus a character in progress


def test_invalid_bytes_are_not_held_forever(tok: Tokenizer) -> None:
    continuation_byte = tok.token_to_id("¡")  # byte 0xA1 in the byte-level alphabet
    ids = [continuation_byte] * 200
    spy = _WindowSpy(tok)
    detok = IncrementalDetokenizer(spy, [])  # type: ignore[arg-type]
    deltas = [detok.add_tokens([i]) for i in ids]
    assert sum(map(len, deltas)) > 150  # released while streaming, not only at flush
    assert "".join([*deltas, detok.flush()]) == tok.decode(ids) == FFFD * 200
    assert spy.longest <= 64 + 4


@pytest.mark.parametrize("text", ["cat at a tact", "té 天 😀 ü 🦀 at"])
def test_decoder_that_strips_the_first_space(sentencepiece_like: Tokenizer, text: str) -> None:
    tok = sentencepiece_like
    ids = tok.encode(text)
    deltas = _stream(IncrementalDetokenizer(tok, []), ids)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    # After a prompt the first output token keeps its leading space, as in the full text.
    prompt = tok.encode("tact")
    deltas = _stream(IncrementalDetokenizer(tok, prompt), ids)
    assert "".join(deltas) == " " + text == tok.decode(prompt + ids)[len("tact") :]
