"""Dataset loaders on small fixtures: random, shared-prefix, ShareGPT files, random images."""

import base64
import io
import json

import pytest
from PIL import Image

from services.bench.datasets import DatasetOptions, load_dataset
from services.bench.payload import CHAT, COMPLETIONS, Sampling, request_body
from services.bench.tokens import TokenSource, load_tokenizer


@pytest.fixture(scope="module")
def tiny_tokens() -> TokenSource:
    return TokenSource(load_tokenizer(None, "deepinfer-tiny"))


def test_random_token_ids_have_the_lengths_asked_for(tiny_tokens):
    options = DatasetOptions(
        "random", 50, seed=1, token_ids=True, random_input_len=40, random_output_len=10, random_range_ratio=0.5
    )
    requests = load_dataset(options, tiny_tokens)
    assert len(requests) == 50
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15 for r in requests)
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert len({r.prompt_len for r in requests}) > 5  # spread, not one length
    special = set(tiny_tokens.tokenizer.get_added_tokens_decoder())
    assert not special & {t for r in requests for t in r.prompt}
    assert load_dataset(options, tiny_tokens) == requests  # same seed, same requests


def test_random_text_is_exact_with_a_tokenizer_and_estimated_without(tiny_tokens):
    options = DatasetOptions("random", 5, random_input_len=64, random_output_len=8)
    for r in load_dataset(options, tiny_tokens):
        assert isinstance(r.prompt, str) and r.prompt_len == 64 == tiny_tokens.count(r.prompt)
    for r in load_dataset(options, TokenSource(None)):
        assert len(r.prompt.split()) == r.prompt_len == 64
    with pytest.raises(ValueError, match="tokenizer"):
        load_dataset(DatasetOptions("random", 1, token_ids=True), TokenSource(None))


def test_shared_prefix_groups_share_exactly_their_prefix(tiny_tokens):
    options = DatasetOptions(
        "shared-prefix",
        1,  # ignored: shared-prefix makes groups x prompts per group
        token_ids=True,
        shared_prefix_num_groups=3,
        shared_prefix_prompts_per_group=4,
        shared_prefix_len=32,
        shared_prefix_suffix_len=8,
    )
    requests = load_dataset(options, tiny_tokens)
    assert len(requests) == 12
    prefixes = {tuple(r.prompt[:32]) for r in requests}
    assert len(prefixes) == 3
    assert all(r.prompt_len == 40 for r in requests)
    assert sum(tuple(r.prompt[:32]) == tuple(requests[0].prompt[:32]) for r in requests) == 4
    assert len({tuple(r.prompt[32:]) for r in requests}) == 12


def write(tmp_path, data) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Tell me about the sea and its tides please"},
            {"from": "gpt", "value": "The sea rises and falls twice a day with the moon"},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "only one turn here, so it is skipped"}]},
    {
        "id": "c",
        "conversations": [
            {"role": "user", "content": "What is the tallest mountain on the earth"},
            {"role": "assistant", "content": "Mount Everest is the tallest one above the sea"},
        ],
    },
]


def test_sharegpt_takes_the_first_turn_and_sizes_the_reply(tmp_path, tiny_tokens):
    path = write(tmp_path, SHAREGPT)
    requests = load_dataset(DatasetOptions("sharegpt", 2, path=path), tiny_tokens)
    prompts = {r.prompt for r in requests}
    assert prompts == {SHAREGPT[0]["conversations"][0]["value"], SHAREGPT[2]["conversations"][0]["content"]}
    for r in requests:
        assert r.prompt_len == tiny_tokens.count(r.prompt)
        assert r.output_len > 4
    fixed = load_dataset(DatasetOptions("sharegpt", 5, path=path, sharegpt_output_len=7), tiny_tokens)
    assert len(fixed) == 5 and {r.output_len for r in fixed} == {7}  # 2 usable entries, reused


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a valid JSON file"),
        ('{"conversations": []}', "expected a JSON list"),
        ('[{"id": 1}]', "entry 0 has no 'conversations'"),
        ('[{"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]', "without a 'value'"),
        ('[{"conversations": [{"from": "human", "value": "hi"}]}]', "no conversation"),
    ],
)
def test_a_malformed_sharegpt_file_is_named_in_the_error(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(DatasetOptions("sharegpt", 3, path=path), TokenSource(None))
    assert path in str(info.value)
    with pytest.raises(FileNotFoundError):
        load_dataset(DatasetOptions("sharegpt", 3, path=str(tmp_path / "missing.json")), TokenSource(None))


def test_random_mm_sends_png_data_urls_as_chat_image_parts(tiny_tokens):
    options = DatasetOptions(
        "random-mm",
        3,
        random_input_len=16,
        random_output_len=4,
        random_mm_base_items_per_request=2,
        random_mm_image_size=(24, 16),
    )
    requests = load_dataset(options, tiny_tokens)
    assert all(len(r.images) == 2 for r in requests)
    url = requests[0].images[0]
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert (image.format, image.size) == ("PNG", (24, 16))
    body = request_body(CHAT, "m", requests[0], Sampling())
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]
    assert parts[1]["image_url"]["url"] == url and body["max_completion_tokens"] == requests[0].output_len
    with pytest.raises(ValueError, match="chat endpoint"):
        request_body(COMPLETIONS, "m", requests[0], Sampling())
