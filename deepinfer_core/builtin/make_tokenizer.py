"""Rebuild the embedded tokenizer of the tiny built-in model.

The tiny model has to run with no download, so its tokenizer ships inside the package
(`builtin/tiny/`). This script regenerates those files from text held right here, so the asset
can always be rebuilt and reviewed. It is a byte-level BPE (the scheme of Llama-3, Qwen2 and
DeepSeek-V3): the 256-symbol byte alphabet is always in the vocabulary, so every UTF-8 string
round-trips, and merges learnt from the corpus below fill the rest of the 1024 ids.

Run: ``python -m deepinfer_core.builtin.make_tokenizer [OUT_DIR]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 1024
BOS, EOS, IM_START, IM_END, IMAGE, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|pad|>",
)
# Appended after the learnt vocabulary, in this order: ids 1018..1023.
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, IMAGE, PAD]
DEFAULT_OUT_DIR = Path(__file__).parent / "tiny"

# Contractions, letter runs (with one leading non-letter), single digits, punctuation runs and
# whitespace: digits stay single so numbers tokenize the same way wherever they appear.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. Content is a string or a list of OpenAI-style parts; image parts become <|image|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|image|>' -}}"
    "{%- else -%}"
    "{{- raise_exception('unsupported content part type: ' + part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CORPUS = [
    """The river was low that autumn, and the boats that usually crowded the harbour had moved
south before the first frost. Anna walked along the old stone wall every morning, counting the
herons on the far bank. Some days there were three; on quiet, grey days there were as many as
eleven. She kept the numbers in a small notebook with a green cover, next to notes about the
weather, the price of bread and the names of the ships she remembered from her childhood.""",
    """When you cook rice, rinse it first until the water runs clear. Use one part rice to one and
a half parts water, bring it to a boil, then lower the heat and cover the pot. After fifteen
minutes, take it off the stove and let it rest for another ten. Don't lift the lid too early:
the steam is doing most of the work. If you're making a larger batch, you'll need a wider pot
rather than a deeper one, so that the grains cook evenly.""",
    """Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many days are there in a leap year?
Answer: A leap year has 366 days, one more than a common year.
Question: Why is the sky blue?
Answer: Sunlight is scattered by the molecules in the air, and blue light is scattered more
than red light because it has a shorter wavelength.""",
    """def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


if __name__ == "__main__":
    for i, x in enumerate(fibonacci(10)):
        print(f"{i}: {x}")
""",
    """#include <stdio.h>

int main(void) {
    int total = 0;
    for (int i = 0; i < 100; i++) {
        if (i % 3 == 0 || i % 5 == 0) {
            total += i;
        }
    }
    printf("total = %d\\n", total);
    return 0;
}
""",
    """{"id": 42, "name": "sensor-7", "active": true, "readings": [12.5, 13.0, 12.75, 14.25],
 "location": {"lat": 48.8566, "lon": 2.3522}, "tags": ["outdoor", "temperature"], "error": null}
SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;
<html><body><h1>Hello, world!</h1><p class="note">This is a paragraph.</p></body></html>""",
    """In 1969, 600 million people watched the first landing on the Moon. The distance from the
Earth to the Moon is about 384,400 kilometres, and light covers it in roughly 1.28 seconds.
A marathon is 42.195 km long; the world record is a little over 2 hours. Water boils at
100 degrees Celsius (212 degrees Fahrenheit) at sea level. 2 + 2 = 4, 7 * 8 = 56, 144 / 12 = 12,
3.14159 is close to pi, and 2^10 = 1024. Call +1 (555) 010-9999 or write to info@example.com.""",
    """The committee met on Tuesday to review the budget. Several members argued that the library
should open later on weekends, while others wanted more money spent on repairs to the roof.
After a long discussion, they agreed to a compromise: the library would stay open until eight
o'clock on Saturdays, and the repairs would begin in spring. Everyone seemed satisfied, although
the treasurer warned that costs could rise if the winter turned out to be especially harsh.""",
    """Mathematics is the study of patterns. A prime number has exactly two divisors: one and
itself. The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Every even number greater
than two seems to be the sum of two primes, but nobody has proved it. The square root of two is
irrational, which means it cannot be written as a fraction of two whole numbers.""",
    """Dear Sam,
Thank you for your letter. I'm sorry it took me so long to reply; the last few weeks have been
busy with the move. The new flat is small but bright, and there's a bakery just across the
street that sells the best croissants I've ever had. Please come and visit whenever you like.
Best wishes,
Maria""",
    """Les enfants jouent dans le jardin. Der Hund schläft unter dem Tisch. El café está muy
caliente. Ça coûte cinq euros. Über den Wolken ist die Freiheit grenzenlos. Mañana será otro día.
Привет, как дела? Это хороший день. 今天天气很好，我们去公园散步吧。東京は日本の首都です。
안녕하세요, 만나서 반갑습니다. Γεια σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया. 🙂 👍 🎉 ❤️ ✨ → ≤ ≥ ± × ÷ € £ ¥ °""",
    """- Install the package with pip.
- Run the tests before you open a pull request.
- Keep functions short and give them clear names.
1. Read the error message carefully.
2. Search for the exact text of the message.
3. Write a small example that reproduces the problem.
| Name  | Age | City     |
|-------|-----|----------|
| Alice | 34  | Berlin   |
| Bob   | 27  | Toronto  |""",
    """Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker
who could fix anything that ticked. People brought him watches, music boxes and even a
mechanical bird that had forgotten how to sing. One evening a girl knocked on his door holding a
broken compass. "It always points to the thing you want most," she said, "but now it only
spins." The clockmaker smiled, put on his glasses and opened the little brass case.""",
]


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on CORPUS and append the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    tokenizer.add_special_tokens(specials)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"expected {VOCAB_SIZE} tokens, training produced {size}")
    return tokenizer


def build_tokenizer_config(tokenizer: Tokenizer) -> dict:
    """The tokenizer_config.json that goes with `tokenizer` (Hugging Face layout)."""
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write(out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = build_tokenizer_config(tokenizer)
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT_DIR)
