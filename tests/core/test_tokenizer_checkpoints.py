"""Tokenizer loading from the layouts real checkpoints ship (Qwen2, Llama-3, DeepSeek-V3, a bare
tokenizer.json), checked against transformers."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional

import pytest
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from deepinfer_core.builtin import make_tokenizer
from deepinfer_core.tokenizer import load_tokenizer
from tests.helpers.tokenizers import CONVERSATIONS, SAMPLES, TINY_DIR


@functools.cache
def _learnt_vocab_json() -> str:
    spec = json.loads((TINY_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = []
    return json.dumps(spec)


def _byte_level_bpe(specials: list[str]) -> BackendTokenizer:
    """The tiny tokenizer's learnt vocabulary with `specials` appended instead of its own."""
    backend = BackendTokenizer.from_str(_learnt_vocab_json())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def _write_checkpoint(
    root: Path,
    backend: BackendTokenizer,
    config: dict[str, Any],
    generation_config: Optional[dict[str, Any]] = None,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "special": t.special, "normalized": False}
        for i, t in backend.get_added_tokens_decoder().items()
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, **config}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    return root


def _added_token_dict(content: str) -> dict[str, Any]:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}  # fmt: skip


@pytest.fixture(scope="module")
def qwen_like_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 layout: no bos, eos <|im_end|>, end-of-text ids in generation_config."""
    backend = _byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    config = {
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": make_tokenizer.CHAT_TEMPLATE,
    }
    end_ids = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    root = tmp_path_factory.mktemp("qwen_like")
    return _write_checkpoint(root, backend, config, {"eos_token_id": end_ids})


@pytest.fixture(scope="module")
def llama_like_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3 layout: the post-processor adds bos; the template writes bos itself."""
    backend = _byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos_id)],
    )
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": _added_token_dict("<|end_of_text|>"),
        "chat_template": "{{- bos_token }}{% for m in messages %}{{ m['role'] + ': ' + "
        "m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}assistant: "
        "{% endif %}",
    }
    return _write_checkpoint(tmp_path_factory.mktemp("llama_like"), backend, config)


def _write_deepseek_like(root: Path, bos_in_post_processor: bool) -> Path:
    """DeepSeek-V3 layout: add_bos_token in the config, AddedToken dicts for bos/eos."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    backend = _byte_level_bpe([bos, eos])
    if bos_in_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": _added_token_dict(bos),
        "eos_token": _added_token_dict(eos),
    }
    return _write_checkpoint(root, backend, config)


@pytest.mark.parametrize(
    ("layout", "adds_bos"),
    [("qwen_like_dir", False), ("llama_like_dir", True)],
)
def test_encode_matches_transformers_on_checkpoint_layouts(
    request: pytest.FixtureRequest, layout: str, adds_bos: bool
) -> None:
    from transformers import AutoTokenizer

    root = request.getfixturevalue(layout)
    ours, theirs = load_tokenizer(root), AutoTokenizer.from_pretrained(root)
    for text in SAMPLES[:-1]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert (ids[:1] == [ours.bos_token_id]) is adds_bos
        assert ids.count(ours.bos_token_id) <= 1 or "<|begin_of_text|>" in text


@pytest.mark.parametrize("bos_in_post_processor", [True, False])
def test_add_bos_token_in_config_adds_exactly_one_bos(tmp_path: Path, bos_in_post_processor: bool) -> None:
    tok = load_tokenizer(_write_deepseek_like(tmp_path, bos_in_post_processor))
    assert tok.bos_token_id == tok.token_to_id("<｜begin▁of▁sentence｜>")
    assert tok.eos_token_id == tok.token_to_id("<｜end▁of▁sentence｜>")
    for text in SAMPLES:
        plain = tok.encode(text, add_special_tokens=False)
        assert tok.encode(text) == [tok.bos_token_id, *plain]
    ids = tok.encode("x<｜end▁of▁sentence｜>")
    assert tok.decode(ids) == "x"
    assert tok.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>x<｜end▁of▁sentence｜>"


def test_qwen_like_ids(qwen_like_dir: Path) -> None:
    tok = load_tokenizer(qwen_like_dir)
    im_end, end_of_text = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None
    assert tok.eos_token_id == im_end and tok.pad_token_id == end_of_text
    assert tok.stop_token_ids == [im_end, end_of_text]


def test_llama_like_chat_has_a_single_bos(llama_like_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(llama_like_dir)
    eot = tok.token_to_id("<|eot_id|>")
    assert tok.eos_token_id == tok.token_to_id("<|end_of_text|>")
    assert tok.stop_token_ids == [tok.eos_token_id, eot]
    messages = CONVERSATIONS[1]
    ids = tok.encode_chat(messages)
    theirs = AutoTokenizer.from_pretrained(llama_like_dir)
    assert ids == theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1


def test_special_tokens_named_only_in_config_are_added(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = {"eos_token": "<|eos|>", "additional_special_tokens": ["<tool>"]}
    root = _write_checkpoint(tmp_path, _byte_level_bpe([]), config)
    ours, theirs = load_tokenizer(root), AutoTokenizer.from_pretrained(root)
    text = "call <tool> then stop<|eos|>"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.eos_token_id == theirs.eos_token_id == 1018
    assert ours.all_special_ids == {1018, 1019}
    assert ours.decode(ours.encode(text)) == "call  then stop"


def test_eos_ids_from_model_configs_are_validated(tmp_path: Path) -> None:
    root = _write_checkpoint(tmp_path, _byte_level_bpe(["<|eos|>"]), {"eos_token": "<|eos|>"})
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 99999]}))
    (root / "config.json").write_text(json.dumps({"eos_token_id": 8}))
    tok = load_tokenizer(root)
    assert tok.stop_token_ids == [tok.token_to_id("<|eos|>"), 7, 8]


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def test_tokenizer_json_alone_is_enough(tmp_path: Path) -> None:
    _byte_level_bpe([]).save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("plain")) == "plain"
    assert tok.eos_token_id is None and tok.stop_token_ids == []
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_chat_template_file_and_named_templates(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    root = _write_checkpoint(tmp_path, _byte_level_bpe([]), {"chat_template": named})
    tok = load_tokenizer(root)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "D"
    assert tok.apply_chat_template(CONVERSATIONS[0], tools=[{"name": "f"}]) == "T"
    (root / "chat_template.jinja").write_text("F", encoding="utf-8")
    assert load_tokenizer(root).apply_chat_template(CONVERSATIONS[0]) == "F"
