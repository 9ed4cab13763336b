"""check_stop: each rule, their priority, min_tokens gating and stop-string search."""

from __future__ import annotations

from typing import Optional

from deepinfer_core.sampling.stop_checker import StopDecision, check_stop
from deepinfer_core.sampling_params import SamplingParams

EOS = 2


def check(
    params: SamplingParams,
    tokens: list[int],
    text: str = "",
    new_text_len: Optional[int] = None,
    eos: Optional[int] = EOS,
    num_prompt: int = 5,
    max_model_len: int = 1000,
) -> StopDecision:
    """Defaults: the whole text is new and the context is far from full."""
    new = len(text) if new_text_len is None else new_text_len
    return check_stop(params, tokens, text, new, eos, num_prompt, max_model_len)


def stopped(decision: StopDecision, stop_reason=None, truncate_text_to=None) -> bool:
    return decision == StopDecision(True, "stop", stop_reason, truncate_text_to)


def test_not_finished() -> None:
    decision = check(SamplingParams(max_tokens=10, stop=["END"]), [5, 6], "hello")
    assert decision == StopDecision(False, None, None, None)


def test_eos_stops_without_stop_reason() -> None:
    assert stopped(check(SamplingParams(), [5, EOS]))


def test_eos_only_counts_as_last_token() -> None:
    assert not check(SamplingParams(), [EOS, 5]).finished


def test_ignore_eos() -> None:
    assert not check(SamplingParams(ignore_eos=True), [5, EOS]).finished


def test_no_eos_token() -> None:
    assert not check(SamplingParams(), [5, EOS], eos=None).finished


def test_stop_token_id_is_the_stop_reason() -> None:
    params = SamplingParams(stop_token_ids=[7, 9])
    assert stopped(check(params, [5, 9]), stop_reason=9)
    assert not check(params, [9, 5]).finished


def test_stop_token_id_applies_with_ignore_eos() -> None:
    assert stopped(check(SamplingParams(ignore_eos=True, stop_token_ids=[EOS]), [5, EOS]), stop_reason=EOS)


def test_stop_string_in_new_text_truncates_before_it() -> None:
    text = "The answer is 42. END of story"
    decision = check(SamplingParams(stop="END"), [1, 3, 4], text, new_text_len=len(" END of story"))
    assert stopped(decision, stop_reason="END", truncate_text_to=text.index("END"))
    assert text[: decision.truncate_text_to] == "The answer is 42. "


def test_include_stop_str_in_output_truncates_after_it() -> None:
    text = "abc</s>xyz"
    decision = check(SamplingParams(stop=["</s>"], include_stop_str_in_output=True), [1], text, new_text_len=7)
    assert stopped(decision, stop_reason="</s>", truncate_text_to=len("abc</s>"))


def test_stop_string_spanning_two_token_texts() -> None:
    params = SamplingParams(stop=["world"])
    assert not check(params, [1, 3], "Hello wor", new_text_len=4).finished  # "Hello" + " wor"
    text = "Hello world!"  # then "ld!"
    assert stopped(check(params, [1, 3, 4], text, new_text_len=3), stop_reason="world", truncate_text_to=6)
    with_stop = SamplingParams(stop=["world"], include_stop_str_in_output=True)
    assert check(with_stop, [1, 3, 4], text, new_text_len=3).truncate_text_to == len("Hello world")


def test_stop_string_only_in_old_text_is_not_matched_again() -> None:
    # e.g. it appeared while min_tokens still held: only matches ending in new text count
    params = SamplingParams(stop=["STOP"])
    assert not check(params, [1, 3, 4], "xx STOP yy zz", new_text_len=3).finished


def test_no_new_text_means_no_stop_string_check() -> None:
    assert not check(SamplingParams(stop=["STOP"]), [1, 3], "a STOP", new_text_len=0).finished


def test_earliest_stop_string_wins() -> None:
    text = "one two three"
    decision = check(SamplingParams(stop=["three", "two"]), [1], text)
    assert stopped(decision, stop_reason="two", truncate_text_to=text.index("two"))


def test_max_tokens_is_length() -> None:
    params = SamplingParams(max_tokens=3)
    assert not check(params, [5, 6]).finished
    assert check(params, [5, 6, 7]) == StopDecision(True, "length", None, None)


def test_max_model_len_is_length() -> None:
    params = SamplingParams(max_tokens=None)
    assert not check(params, [5] * 4, num_prompt=10, max_model_len=15).finished
    assert check(params, [5] * 5, num_prompt=10, max_model_len=15) == StopDecision(True, "length", None, None)


def test_stop_conditions_take_priority_over_length() -> None:
    params = SamplingParams(max_tokens=2, stop=["!"], stop_token_ids=[9])
    assert stopped(check(params, [5, EOS]))
    assert stopped(check(params, [5, 9]), stop_reason=9)
    assert stopped(check(params, [5, 6], "hi!", new_text_len=1), stop_reason="!", truncate_text_to=2)
    assert stopped(check(SamplingParams(), [5, EOS], num_prompt=10, max_model_len=12))


def test_eos_takes_priority_over_stop_string() -> None:
    decision = check(SamplingParams(stop=["x"]), [5, EOS], "x", new_text_len=1)
    assert stopped(decision)


def test_min_tokens_gates_eos_stop_ids_and_stop_strings() -> None:
    params = SamplingParams(min_tokens=3, stop=["END"], stop_token_ids=[9])
    assert not check(params, [5, EOS]).finished
    assert not check(params, [5, 9]).finished
    assert not check(params, [5, 6], "END", new_text_len=3).finished
    assert stopped(check(params, [5, 6, EOS]))
    assert stopped(check(params, [5, 6, 9]), stop_reason=9)
    assert stopped(check(params, [5, 6, 7], "xEND", new_text_len=2), stop_reason="END", truncate_text_to=1)


def test_context_limit_overrides_min_tokens() -> None:
    params = SamplingParams(min_tokens=10, max_tokens=None)
    decision = check(params, [5, 6], num_prompt=8, max_model_len=10)
    assert decision == StopDecision(True, "length", None, None)
