"""Tokenizer loading and the `Tokenizer` wrapper the engine talks to.

Checkpoints (Llama-3, Qwen2/3, DeepSeek-V3, the tiny built-in model) ship a Hugging Face
`tokenizer.json` plus a `tokenizer_config.json`. We read them with the `tokenizers` library
directly, so the engine never needs `transformers`, and re-apply the few rules transformers
layers on top — special tokens named in the config, `add_bos_token`/`add_eos_token`, the jinja
chat template — so that ids and prompts match what the model was trained on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors

# Special-token slots of tokenizer_config.json, in the order transformers knows them.
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# End-of-turn markers of common chat formats (ChatML, Llama-3, Phi-3): default stops.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


class Tokenizer:
    """A Hugging Face tokenizer read from a checkpoint directory.

    `vocab_size` counts added tokens. `stop_token_ids` is the default stop set: eos, the eos ids
    of generation_config.json / config.json, and the chat end-of-turn tokens the vocab has.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any],
        chat_templates: Optional[dict[str, str]] = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = _named_special_tokens(config)
        _register_special_tokens(backend, config, self._special_tokens)
        _apply_bos_eos_policy(backend, config, self._special_tokens)
        self._chat_templates = dict(chat_templates or {})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        self.all_special_ids: set[int] = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        end_of_turn = [backend.token_to_id(t) for t in _END_OF_TURN_TOKENS]
        self.stop_token_ids: list[int] = self._valid_unique_ids([self.eos_token_id, *extra_eos_ids, *end_of_turn])

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory holding at least tokenizer.json.

        Raises:
            FileNotFoundError: `path` has no tokenizer.json.
        """
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        for key, value in _read_json(root / "special_tokens_map.json").items():
            config.setdefault(key, value)  # legacy file: the config wins
        extra_eos = [
            *_as_id_list(_read_json(root / "generation_config.json").get("eos_token_id")),
            *_as_id_list(_read_json(root / "config.json").get("eos_token_id")),
        ]
        return cls(backend, config, _read_chat_templates(root, config), extra_eos)

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; bos/eos are added only where the tokenizer's config says so."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Encode many texts at once (parallel in the Rust backend, no offset bookkeeping)."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids outside the vocabulary are ignored."""
        return self._backend.decode(_as_list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of `ids` ("" for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join vocabulary strings into text with the tokenizer's decoder."""
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else "".join(tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of one vocabulary string, or None."""
        return self._backend.token_to_id(token)

    # -- chat --------------------------------------------------------------------------------

    @property
    def chat_template(self) -> Optional[str]:
        """The default chat template source, if the checkpoint has one."""
        return self._chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text, as transformers' `apply_chat_template` does.

        Extra keyword arguments (e.g. `enable_thinking`) are passed to the template.

        Raises:
            ValueError: no chat template, malformed messages, or the template rejected them.
        """
        source = chat_template or self._select_template(tools)
        _check_messages(messages)
        context = {**self._special_tokens, **kwargs}
        context.setdefault("documents", None)
        try:
            return _compile_template(source).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template could not render the messages: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids of a conversation. The template writes its own special tokens (e.g. a
        leading bos), so none are added on top — as transformers does with `tokenize=True`."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # -- helpers -----------------------------------------------------------------------------

    def _named_id(self, key: str) -> Optional[int]:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    def _valid_unique_ids(self, ids: Iterable[Optional[int]]) -> list[int]:
        valid = (i for i in ids if i is not None and 0 <= i < self.vocab_size)
        return list(dict.fromkeys(valid))

    def _select_template(self, tools: Optional[list[dict[str, Any]]]) -> str:
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" not in self._chat_templates:
            raise ValueError("this tokenizer has no chat template")
        return self._chat_templates["default"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of the checkpoint at `path` (see `Tokenizer.from_pretrained`)."""
    return Tokenizer.from_pretrained(path)


# -- config reading ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> Optional[str]:
    """A special token is written either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    named = {key: _token_content(config.get(key)) for key in _NAMED_SPECIAL_KEYS}
    return {key: token for key, token in named.items() if token is not None}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else [int(i) for i in ids]


def _read_chat_templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name; a chat_template.jinja file overrides the config's default."""
    raw = config.get("chat_template")
    if isinstance(raw, list):  # named templates: [{"name": ..., "template": ...}]
        templates = {t["name"]: t["template"] for t in raw}
    else:
        templates = {"default": raw} if isinstance(raw, str) else {}
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _register_special_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any], named: dict[str, str]) -> None:
    """Make sure every token the config calls special is a special token of the backend, so
    that encode matches it whole and `skip_special_tokens` drops it (transformers does the same)."""
    added = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(added.items(), key=lambda item: int(item[0])):
        if backend.token_to_id(entry["content"]) is None:
            token = AddedToken(entry["content"], special=bool(entry.get("special")), normalized=False)
            backend.add_tokens([token])
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else extra  # {"image_token": ...} form
    wanted = [*named.values(), *(_token_content(t) for t in extra if isinstance(t, (str, dict)))]
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    missing = [t for t in dict.fromkeys(wanted) if t is not None and t not in special]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _apply_bos_eos_policy(backend: tokenizers.Tokenizer, config: dict[str, Any], named: dict[str, str]) -> None:
    """bos/eos are added when tokenizer.json's post-processor adds them or when the config's
    add_bos_token/add_eos_token asks for them (DeepSeek-V3 relies on the flag; transformers 4's
    Llama tokenizer honoured it, transformers 5 reads only the post-processor)."""
    probe = backend.encode("a").ids
    bos, eos = named.get("bos_token"), named.get("eos_token")
    bos_id = None if bos is None else backend.token_to_id(bos)
    eos_id = None if eos is None else backend.token_to_id(eos)
    add_bos = bool(config.get("add_bos_token")) and bos_id is not None and probe[:1] != [bos_id]
    add_eos = bool(config.get("add_eos_token")) and eos_id is not None and probe[-1:] != [eos_id]
    if not (add_bos or add_eos):
        return
    single = [f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos
    pair = single + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos
    specials = [(bos, bos_id)] * add_bos + [(eos, eos_id)] * add_eos
    template = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)
    current = backend.post_processor
    backend.post_processor = template if current is None else processors.Sequence([current, template])


# -- chat templates --------------------------------------------------------------------------------


def _check_messages(messages: Any) -> None:
    """A conversation is a non-empty list of {role, content} dicts; content is a string, a list
    of typed parts, or None (an assistant turn that only carries tool_calls)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{i}] has no 'content'")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(_is_part(p) for p in content):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of {{'type': ...}} parts")


def _is_part(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("type"), str)


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers marks assistant text with
    it to build training masks); here it simply renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """json.dumps without jinja's HTML escaping, with the options templates pass."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    """Checkpoint templates are untrusted code: render them in jinja's immutable sandbox, with
    the same options, filters and globals as transformers so that they render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from exc
