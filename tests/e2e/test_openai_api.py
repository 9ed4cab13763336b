"""The OpenAI API of a running disaggregated cluster, through the official `openai` client
and raw HTTP (SSE parsing by hand)."""

import json

import httpx
import openai
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_NAME

PROMPTS = ["Hello, my name is", "The capital of France is", "a"]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the NORMAL engine in this process."""
    llm = LLM(max_model_len=512, num_gpu_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return {p: llm.generate(p, params)[0].outputs[0] for p in PROMPTS}


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == TINY_MODEL_NAME


def test_completion_equals_the_engine_and_reports_usage(client, reference):
    for prompt in PROMPTS:
        r = client.completions.create(
            model=TINY_MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == reference[prompt].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0


def test_streamed_completion_concatenates_to_the_whole_text(client, reference):
    prompt = PROMPTS[0]
    stream = client.completions.create(
        model=TINY_MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[prompt].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=TINY_MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_seed_stop_and_logprobs(client, reference):
    r = client.completions.create(
        model=TINY_MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = client.completions.create(
        model=TINY_MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=2
    )
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeds make samples reproducible
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) >= 1 and all(len(t) <= 2 for t in lp.top_logprobs)
    want = reference[PROMPTS[0]].text
    stop = want[3:5]
    r = client.completions.create(
        model=TINY_MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want[: want.index(stop)]
    chat = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_raw_sse_stream(cluster, reference):
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{cluster.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference[PROMPTS[2]].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
