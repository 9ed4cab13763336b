"""SamplingParams: every validation rule, the normalisations and greedy handling."""

from __future__ import annotations

import pytest

from deepinfer_core.sampling_params import SamplingParams

INVALID = [
    ("n", {"n": 0}),
    ("temperature", {"temperature": -0.5}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.1}),
    ("frequency_penalty", {"frequency_penalty": 3.0}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 9, "max_tokens": 8}),
    ("logprobs", {"logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": -3}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": ["ok", 7]}),
    ("stop_token_ids", {"stop_token_ids": [3, -1]}),
]


@pytest.mark.parametrize("field_name,kwargs", INVALID, ids=[f"{f}={v}" for f, v in INVALID])
def test_invalid_values_raise_naming_field_and_value(field_name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert field_name in message
    assert repr(kwargs[field_name]) in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"min_tokens": 8, "max_tokens": 8},
        {"min_tokens": 10_000, "max_tokens": None},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"temperature": 0.0},
        {"top_k": 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_top_k_minus_one_normalises_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_normalises_to_list() -> None:
    assert SamplingParams().stop == []
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(4, 5)).stop_token_ids == [4, 5]


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert not SamplingParams().is_greedy


def test_greedy_ignores_top_p_top_k_min_p() -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    sampled = SamplingParams(temperature=0.5, top_p=0.5, top_k=3, min_p=0.2)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 3, 0.2)


def test_greedy_still_validates_filters() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.0, top_p=2.0)


def test_clone_is_deep() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    twin = params.clone()
    assert twin == params
    twin.stop.append("y")
    twin.stop_token_ids.append(2)
    assert params.stop == ["x"] and params.stop_token_ids == [1]


def test_clone_copies_every_field_that_is_not_a_scalar() -> None:
    """`clone` copies the two list fields by hand; a new field of another mutable kind must be copied too."""
    import dataclasses

    params = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3, logprobs=2)
    twin = params.clone()
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        assert getattr(twin, f.name) == value and getattr(twin, f.name) is not value, f.name
