"""Incremental detokenization for streaming output.

Decoding one token at a time is wrong in two ways: byte-level tokens can end in the middle of a
UTF-8 character (which decodes to U+FFFD), and some decoders depend on the previous token (a
SentencePiece-style decoder strips the leading space of the first token it sees). So, as vLLM
does, we decode a short window of tokens: its head (`window[:read_offset]`) holds the last few
tokens already emitted, kept only as context, and its tail the tokens not yet fully emitted.
Each step decodes the window. When its text ends on a character boundary, the new text is
released and the window slides so that only a few tokens of context remain; the cost per token
is the size of the window, not the length of the output. When it ends in U+FFFD (a character
whose remaining bytes may still come), nothing is released, not even the text before that
character (as vLLM's detokenizer does): so a step that releases text always ends on a character
boundary of the output's bytes, and the text so far is then the decoding of the tokens so far.
Request migration relies on that: it continues a stream from such a step, with the tokens so far
as the new prompt (`services/router/migration.py`).

Guarantee: after every step `output_text` is `tokenizer.decode(output_ids[:m], skip_special_tokens)`
for the last step m whose decode did not end in U+FFFD, and after `flush()` the whole decode; so
no delta carries a U+FFFD made by splitting a character across tokens. Exceptions:
- with a decoder that strips the first token's leading space (SentencePiece/Metaspace), a
  non-empty prompt gives the first output token context, so the stream keeps that space while
  `decode(output_ids)` alone drops it (vLLM behaves the same);
- when `_MAX_HELD_TOKENS` tokens in a row never end on a character boundary (invalid bytes from
  a degenerate model), the held U+FFFDs are released and decoding restarts, so a character
  completed after that point would read as U+FFFDs.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_core.tokenizer import Tokenizer

# Prompt tokens kept as decoding context for the first output token; emitted tokens kept as
# context for the next ones. One is enough for the known decoders; a few cost nothing.
_CONTEXT_TOKENS = 4
# Bound on tokens decoded again and again while their text never ends on a character boundary.
_MAX_HELD_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas as they are sampled."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped special tokens decode to nothing, so they never enter the window; nor do
        # out-of-vocabulary ids, which decode ignores as well.
        self._dropped_ids = tokenizer.all_special_ids if skip_special_tokens else set()
        self._output_text = ""
        self._restart(self._prompt_context(prompt_token_ids))

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return self._output_text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append sampled tokens; return the text they complete (may be "")."""
        kept = [i for i in new_token_ids if self._is_text_token(i)]
        if not kept:
            return ""
        self._window.extend(kept)
        text = self._decode(self._window)
        if not text.endswith(_REPLACEMENT_CHAR):  # on a character boundary: release, keep a little context
            delta = self._release(text, len(text))
            self._restart(self._window[-_CONTEXT_TOKENS:])
            return delta
        if len(self._window) - self._read_offset >= _MAX_HELD_TOKENS:  # invalid bytes: let them go
            delta = self._release(text, len(text))
            self._restart([])
            return delta
        return ""  # inside a character: hold all of this text until it ends

    def flush(self) -> str:
        """At the end of the stream, release whatever is still held back."""
        delta = self._release(self._decode(self._window), None)
        self._restart([])
        return delta

    def _release(self, text: str, end: int | None) -> str:
        """Emit `text[emitted:end]`; `text` is the window's decode, which only ever grows."""
        delta = text[self._emitted : end]
        self._emitted += len(delta)
        self._output_text += delta
        return delta

    def _restart(self, context: list[int]) -> None:
        """Start a window whose head is `context`: tokens already emitted, ending on a
        character boundary, kept only so the decoder sees what precedes the next token."""
        self._window = context
        self._read_offset = len(context)
        self._emitted = len(self._decode(context))

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _is_text_token(self, token_id: int) -> bool:
        return 0 <= token_id < self._tokenizer.vocab_size and token_id not in self._dropped_ids

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few prompt tokens, or none if they end inside a character (the output
        then decodes on its own, exactly as `decode(output_ids)` would)."""
        tail = [i for i in prompt_token_ids[-_CONTEXT_TOKENS:] if self._is_text_token(i)]
        return [] if self._decode(tail).endswith(_REPLACEMENT_CHAR) else tail
