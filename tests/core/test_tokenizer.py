"""Tokenizer loading, the embedded tokenizer and chat templates, checked against transformers."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional

import pytest
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from deepinfer_core.builtin import make_tokenizer
from deepinfer_core.tokenizer import Tokenizer, load_tokenizer

TINY_DIR = Path(make_tokenizer.__file__).parent / "tiny"
TINY_SPECIAL_IDS = {
    "<|begin_of_text|>": 1018,
    "<|end_of_text|>": 1019,
    "<|im_start|>": 1020,
    "<|im_end|>": 1021,
    "<|image|>": 1022,
    "<|pad|>": 1023,
}
SAMPLES = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 ≈ π.",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文测试：今天天气很好。日本語のテキスト。한국어 텍스트",
    "combining: e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Z\u0351\u0352\u0353",
    "whitespace:   three\t\ttabs\n\n\nnewlines \r\n   trailing   ",
    'def f(x: int) -> int:\n    return {"a": [x ** 2]}["a"][0]  # comment\n',
    "<|im_start|>user\nhi<|im_end|>\n<|image|> and <|pad|> inline",
    "",
    " ",
    "\x00\x01\x7f nul and control",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " briefly."},
            ],
        }
    ],
]


# Exercises what real templates use: namespace, tojson, loop controls, tool calls, whitespace
# control under trim_blocks/lstrip_blocks, extra keyword arguments.
RICH_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}
{{- bos_token -}}
{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %},{% endif %}{% endfor %}</tools>
{% endif %}
{%- if ns.system %}[SYS]{{ ns.system | trim }}[/SYS]
{% endif %}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- if message.tool_calls is defined and message.tool_calls %}
    {%- for call in message.tool_calls %}<call>{{ call.function.name }}({{ call.function.arguments | tojson }})</call>
    {% endfor %}
  {%- else %}
<{{ message.role }}>{{ message.content }}</{{ message.role }}>
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}"""


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer(TINY_DIR)


@pytest.fixture(scope="module")
def hf_tiny() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_DIR)


# -- the embedded tokenizer ------------------------------------------------------------------------


def test_vocab_size_and_special_token_ids(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 1024
    assert {t: tiny.token_to_id(t) for t in TINY_SPECIAL_IDS} == TINY_SPECIAL_IDS
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.pad_token_id) == (1018, 1019, 1023)
    assert tiny.stop_token_ids == [1019, 1021]
    assert tiny.all_special_ids == set(TINY_SPECIAL_IDS.values())


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tiny: Tokenizer, text: str) -> None:
    ids = tiny.encode(text)
    assert tiny.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < tiny.vocab_size for i in ids)


def test_every_code_point_round_trips(tiny: Tokenizer) -> None:
    planes = [range(0, 0xD800), range(0xE000, 0x11000), range(0x1F000, 0x1FB00), [0x10FFFF]]
    text = "".join(chr(c) for plane in planes for c in plane)
    assert tiny.decode(tiny.encode(text)) == text


def test_special_tokens_encode_whole_and_are_skipped(tiny: Tokenizer) -> None:
    ids = tiny.encode("a<|im_end|>b<|image|>")
    assert TINY_SPECIAL_IDS["<|im_end|>"] in ids and TINY_SPECIAL_IDS["<|image|>"] in ids
    assert tiny.decode(ids) == "ab"


def test_no_bos_is_added(tiny: Tokenizer) -> None:
    assert tiny.encode("hello") == tiny.encode("hello", add_special_tokens=False)
    assert tiny.bos_token_id not in tiny.encode("hello")


def test_encode_batch_matches_encode(tiny: Tokenizer) -> None:
    assert tiny.encode_batch(SAMPLES) == [tiny.encode(s) for s in SAMPLES]


def test_tokens_to_string(tiny: Tokenizer) -> None:
    ids = tiny.encode(SAMPLES[2] + SAMPLES[7])
    tokens = tiny.convert_ids_to_tokens(ids)
    assert tiny.convert_tokens_to_string(tokens) == tiny.decode(ids, skip_special_tokens=False)
    assert tiny.convert_ids_to_tokens([5000]) == [""]


def test_encode_matches_transformers(tiny: Tokenizer, hf_tiny: Any) -> None:
    for text in SAMPLES:
        assert tiny.encode(text) == hf_tiny.encode(text), text
        assert tiny.decode(tiny.encode(text)) == hf_tiny.decode(hf_tiny.encode(text), skip_special_tokens=True)


def test_embedded_tokenizer_is_reproducible() -> None:
    rebuilt = json.loads(make_tokenizer.build_tokenizer().to_str())
    shipped = json.loads((TINY_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    assert rebuilt["model"] == shipped["model"]
    assert rebuilt["added_tokens"] == shipped["added_tokens"]
    config = json.loads((TINY_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config == make_tokenizer.build_tokenizer_config(make_tokenizer.build_tokenizer())


# -- other checkpoint layouts ------------------------------------------------------------------------


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


# -- chat templates ------------------------------------------------------------------------------------


def test_chat_template_renders_roles_parts_and_generation_prompt(tiny: Tokenizer) -> None:
    assert tiny.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
    )
    assert tiny.apply_chat_template(CONVERSATIONS[2]) == (
        "<|im_start|>user\nDescribe <|image|> briefly.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tiny.encode_chat(CONVERSATIONS[2])
    assert ids.count(TINY_SPECIAL_IDS["<|image|>"]) == 1


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tiny: Tokenizer, hf_tiny: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = tiny.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tiny.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs


def test_rich_template_matches_transformers(tiny: Tokenizer, hf_tiny: Any) -> None:
    messages = [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Weather in Paris? ünïcode"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "21°C"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    kwargs = {"tools": tools, "chat_template": RICH_TEMPLATE, "enable_thinking": False}
    ours = tiny.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    theirs = hf_tiny.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours == theirs
    assert "<call>weather(" in ours and "<think></think>" in ours


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": 3, "content": "x"}],
        ["not a dict"],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"text": "part without a type"}]}],
        [{"role": "user", "content": [{"type": "audio", "audio": "..."}]}],
    ],
)
def test_bad_messages_raise_value_error(tiny: Tokenizer, messages: Any) -> None:
    with pytest.raises(ValueError):
        tiny.apply_chat_template(messages)


def test_template_helpers_and_kwargs(tiny: Tokenizer) -> None:
    template = (
        "{{ strftime_now('%Y')|length }}|{{ tools|tojson }}|{{ flag }}|{{ eos_token }}|"
        "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 0 %}{% break %}{% endif %}x{% endfor %}"
    )
    tools = [{"name": "f", "description": "é"}]
    out = tiny.apply_chat_template(CONVERSATIONS[0], tools=tools, chat_template=template, flag=1)
    assert out == '4|[{"name": "f", "description": "é"}]|1|<|end_of_text|>|Hi there'


@pytest.mark.parametrize("template", ["{{ raise_exception('nope') }}", "{{ ''.__class__.__mro__ }}", "{% if %}"])
def test_template_errors_become_value_errors(tiny: Tokenizer, template: str) -> None:
    with pytest.raises(ValueError):
        tiny.apply_chat_template(CONVERSATIONS[0], chat_template=template)


def test_chat_template_file_and_named_templates(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    root = _write_checkpoint(tmp_path, _byte_level_bpe([]), {"chat_template": named})
    tok = load_tokenizer(root)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "D"
    assert tok.apply_chat_template(CONVERSATIONS[0], tools=[{"name": "f"}]) == "T"
    (root / "chat_template.jinja").write_text("F", encoding="utf-8")
    assert load_tokenizer(root).apply_chat_template(CONVERSATIONS[0]) == "F"
