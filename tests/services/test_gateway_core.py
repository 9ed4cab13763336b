"""Gateway admission and validation as plain units (the e2e bad-input matrix covers HTTP)."""

import json

import pytest

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from services.common.errors import ErrorCode, ServiceError
from services.common.limits import RequestLimits
from services.gateway import validation
from services.gateway.core import GatewayConfig, GatewayCore


def _core(max_n: int = 16, **kw) -> GatewayCore:
    config = GatewayConfig("m", 64, limits=RequestLimits(max_n=max_n), **kw)
    return GatewayCore(config, load_tokenizer(TINY_MODEL_DIR), router=None)


def test_more_requests_than_the_limit_get_429_with_retry_after():
    core = _core(max_concurrent_requests=2)
    params = core.prepare([[1, 2]], {})
    works = [core.admit([[1, 2]], params), core.admit([[1, 2]], params)]
    with pytest.raises(ServiceError) as e:
        core.admit([[1, 2]], params)
    assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED and e.value.http_status == 429
    assert e.value.retry_after_s >= 1
    core.release(works.pop())
    core.admit([[1, 2]], params)


def test_sequences_and_prompt_tokens_are_counted_not_requests():
    core = _core(max_n=16, max_concurrent_sequences=64, max_concurrent_prompt_tokens=100)
    prompts = [[1, 2]] * 64
    with pytest.raises(ServiceError) as e:  # 512 sequences: more than the server ever holds
        core.admit(prompts, core.prepare(prompts, {"n": 8}))
    assert (e.value.http_status, e.value.param) == (400, "n") and "512 sequences" in e.value.message
    held = core.admit(prompts[:6], core.prepare(prompts[:6], {"n": 8}))  # 48 of 64
    with pytest.raises(ServiceError) as e:
        core.admit(prompts[:3], core.prepare(prompts[:3], {"n": 8}))
    assert e.value.http_status == 429 and "sequences in flight" in e.value.message and e.value.retry_after_s
    long = [[1] * 60]
    params = core.prepare(long, {"max_tokens": 1})
    with pytest.raises(ServiceError) as e:  # 120 prompt tokens: more than the server ever holds
        core.admit(long * 2, params)
    assert (e.value.http_status, e.value.param) == (413, "prompt")
    other = core.admit(long, params)  # 12 + 60 of 100 prompt tokens
    with pytest.raises(ServiceError) as e:
        core.admit(long, params)
    assert e.value.http_status == 429 and "prompt tokens in flight" in e.value.message
    core.release(other)
    core.release(held)
    core.admit(prompts[:3], core.prepare(prompts[:3], {"n": 8}))


def test_api_key_needs_the_bearer_scheme_and_the_exact_key():
    core = _core(api_keys=("k",))
    core.check_api_key("Bearer k")
    core.check_api_key("bearer k")
    for header in (None, "", "k", "Bearer", "Bearer x", "Basic k"):
        with pytest.raises(ServiceError) as e:
            core.check_api_key(header)
        assert e.value.http_status == 401
    _core().check_api_key(None)  # no key configured: open


def test_validation_statuses_and_params():
    core = _core(max_n=4)
    cases = [
        (lambda: core.prepare([[1, 2]], {"n": 5}), 400, "n"),
        (lambda: core.prepare([[1, 2]], {"temperature": 2.5}), 400, "temperature"),
        (lambda: core.prepare([[1, 2]], {"top_p": 0.0}), 400, "top_p"),
        (lambda: core.prepare([[1, 2]], {"max_tokens": 0}), 400, "max_tokens"),
        (lambda: core.prepare([list(range(64))], {}), 413, "prompt"),
        (lambda: core.prepare([[1] * 60], {"max_tokens": 10}), 400, "max_tokens"),
        (lambda: validation.check_model("other", "m"), 404, "model"),
        (lambda: validation.encode_prompts([1, 5000], core.tokenizer, core.vocab_size, 64), 400, "prompt"),
        (lambda: validation.encode_prompts("x" * 5000, core.tokenizer, core.vocab_size, 64), 413, "prompt"),
        (lambda: validation.encode_chat([], core.tokenizer, 64), 400, "messages"),
        (lambda: core.prepare([[1, 2]], {"top_k": 2**31}), 400, "top_k"),
        (lambda: core.prepare([[1, 2]], {"seed": 2**70}), 400, "seed"),
        (lambda: core.prepare([[1, 2]], {"stop_token_ids": [10**12]}), 400, "stop_token_ids"),
        (lambda: core.prepare([[1, 2]], {"stop": ["a\ud800"]}), 400, "stop"),
        (lambda: core.prepare([[1, 2]], {"prompt_logprobs": 1}), 400, "prompt_logprobs"),
        (lambda: core.prepare([[1, 2]], {"min_tokens": 100}), 400, "min_tokens"),
    ]
    for call, status, param in cases:
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.http_status, e.value.param) == (status, param), e.value
    params = core.prepare([[1, 2]], {"n": 2, "temperature": 0.5, "max_tokens": None, "stop": "x"})
    assert (params.n, params.temperature, params.max_tokens, params.stop) == (2, 0.5, None, ["x"])
    assert validation.encode_prompts(["a", "b"], core.tokenizer, core.vocab_size, 64) == [
        core.tokenizer.encode("a"),
        core.tokenizer.encode("b"),
    ]


def test_a_streamed_event_stays_one_line_whatever_the_tokens() -> None:
    """Token text with characters that clients split lines on (NEL, the Unicode line and paragraph
    separators) still reaches an httpx `iter_lines` reader as one `data:` line that parses back."""
    from httpx._decoders import LineDecoder

    from services.gateway.chunks import sse

    chunk = {"choices": [{"index": 0, "text": "a\x85b\u2028c\u2029d\re\nf é"}]}
    lines = [ln for ln in LineDecoder().decode(sse(chunk).decode()) if ln]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == chunk
