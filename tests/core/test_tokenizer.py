"""The embedded tokenizer and chat templates, checked against transformers (other checkpoint
layouts: test_tokenizer_checkpoints.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deepinfer_core.builtin import make_tokenizer
from deepinfer_core.tokenizer import Tokenizer, load_tokenizer
from tests.helpers.tokenizers import CONVERSATIONS, SAMPLES, TINY_DIR

TINY_SPECIAL_IDS = {
    "<|begin_of_text|>": 1018,
    "<|end_of_text|>": 1019,
    "<|im_start|>": 1020,
    "<|im_end|>": 1021,
    "<|image|>": 1022,
    "<|pad|>": 1023,
}


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
