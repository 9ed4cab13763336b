"""Counting and making prompt tokens, with the model's tokenizer when one is at hand.

Any OpenAI-compatible server can be measured, and most are not on this machine's disk, so a
tokenizer is optional: without one, prompts are made of plain words and their length is an
estimate (one token a word) that the server's `usage.prompt_tokens` replaces in the results.
"""

from __future__ import annotations

import os
import random
from typing import Optional

from tokenizers import Tokenizer

# Short, common words: most tokenizers give each one token, which keeps the estimate close.
_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did"
).split()


def load_tokenizer(tokenizer: Optional[str], model: str) -> Optional[Tokenizer]:
    """`--tokenizer` (a tokenizer.json or the directory holding one); else the model's own when
    `model` is a local directory or the embedded model; else None."""
    if tokenizer:
        return Tokenizer.from_file(_tokenizer_file(tokenizer))
    if model and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    from deepinfer_core.builtin import TINY_MODEL_DIR, TINY_MODEL_NAME

    if model == TINY_MODEL_NAME:
        return Tokenizer.from_file(os.path.join(TINY_MODEL_DIR, "tokenizer.json"))
    return None


def _tokenizer_file(path: str) -> str:
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there")
    return candidate


class TokenSource:
    """Random prompt tokens and token counts, exact with a tokenizer, estimated without."""

    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.get_added_tokens_decoder())
            self.vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
            self.text_vocab = _whole_tokens(tokenizer, self.vocab)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("token-id prompts need the model's tokenizer: pass --tokenizer PATH")
        return [rng.choice(self.vocab) for _ in range(n)]

    def random_text(self, rng: random.Random, n: int) -> tuple[str, int]:
        """Text of about `n` tokens and its count (exact with a tokenizer)."""
        if n <= 0:
            return "", 0
        if self.tokenizer is None:
            return " ".join(rng.choice(_WORDS) for _ in range(n)), n
        # Decoding random ids and encoding the text again may not give the same ids back (neighbours
        # merge): trim or top up a few times until the re-encoded text has the length asked for.
        ids = [rng.choice(self.text_vocab) for _ in range(n)]
        for _ in range(8):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                return text, n
            ids = ids[:n] + [rng.choice(self.text_vocab) for _ in range(n - len(ids))]
        text = self.tokenizer.decode(ids)
        return text, self.count(text)


def _whole_tokens(tokenizer: Tokenizer, vocab: list[int]) -> list[int]:
    """The tokens that decode to whole characters and encode back to themselves: text made of them
    keeps its length (a byte-level piece of a character decodes to U+FFFD, which encodes longer)."""
    texts = tokenizer.decode_batch([[i] for i in vocab])
    again = tokenizer.encode_batch(texts, add_special_tokens=False)
    whole = [i for i, text, enc in zip(vocab, texts, again) if "\ufffd" not in text and enc.ids == [i]]
    return whole or vocab
