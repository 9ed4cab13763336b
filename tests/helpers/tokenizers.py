"""The embedded tokenizer's directory and the texts and conversations the tokenizer tests share."""

from __future__ import annotations

from pathlib import Path

from deepinfer_core.builtin import make_tokenizer

TINY_DIR = Path(make_tokenizer.__file__).parent / "tiny"
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
