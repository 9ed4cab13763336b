"""Sampling features through the whole engine on the embedded model: n, seed, stop, logprobs."""

import pytest

from deepinfer_core import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, num_gpu_blocks=256, block_size=8, device="cpu")


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    crowd = llm.generate(["noise one", "Once upon a time", "more noise here"], p)[1].outputs[0].token_ids
    assert alone == crowd
    other = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_fork_after_prefill_and_share_the_prompt(llm):
    free0 = llm.engine.scheduler.block_manager.num_free_blocks
    p = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate("The cat sat on the mat and", p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # sample i of a seeded request equals a lone request with seed + i
    lone = llm.generate(
        "The cat sat on the mat and", SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    )
    assert out.outputs[2].token_ids == lone[0].outputs[0].token_ids
    assert llm.engine.scheduler.block_manager.num_free_blocks == free0  # forks released every block


def test_greedy_n_samples_are_identical(llm):
    out = llm.generate("abc", SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_stop_token_ids_and_max_tokens(llm):
    ref = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_at = ref.token_ids[3]
    first = ref.token_ids.index(stop_at)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]))
    c = out[0].outputs[0]
    assert c.token_ids == ref.token_ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    assert ref.finish_reason == "length"


def test_stop_string_truncates_text(llm):
    ref = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = ref.text
    stop = text[5:8]
    cut = text.index(stop)
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    c = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert c.text == text[: cut + len(stop)]


def test_logprobs_of_sampled_tokens(llm):
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(c.logprobs) == 5
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and len(entry) <= 4
        assert entry[tok] == max(entry.values())  # greedy picks the most likely token
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))


def test_text_equals_decode_of_token_ids(llm):
    c = llm.generate("Tell me a story", SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True))[
        0
    ].outputs[0]
    assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert "<|im_start|>assistant" in llm.get_tokenizer().decode(out[0].prompt_token_ids, skip_special_tokens=False)
