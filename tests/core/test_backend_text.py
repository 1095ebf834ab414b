"""The shared text rules of ``batchgen.core.backends.text``: content, stop strings, reasoning."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends import RequestRejected
from batchgen.core.backends.text import (
    flatten_content,
    prompt_opens_reasoning,
    split_reasoning,
    text_messages,
    trim_at_stop,
)

stop_lists = st.lists(st.text(min_size=0, max_size=4), max_size=4)


# --- flatten_content / text_messages ------------------------------------------------------------
@given(st.text())
def test_string_content_is_returned_as_it_is(content: str) -> None:
    assert flatten_content(content, backend="any") == content


@given(st.lists(st.text(), max_size=5))
def test_text_parts_are_joined_with_newlines(texts: list[str]) -> None:
    parts = [{"type": "text", "text": text} for text in texts]
    assert flatten_content(parts, backend="any") == "\n".join(texts)


def test_missing_content_is_empty_and_other_parts_are_rejected_naming_the_backend() -> None:
    assert flatten_content(None, backend="any") == ""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(RequestRejected) as raised:
        flatten_content([{"type": "text", "text": "look"}, image], backend="echo")
    assert raised.value.code == "invalid_request"
    assert raised.value.message == "The echo backend takes text content only, not 'image_url' parts."
    with pytest.raises(RequestRejected, match="not 'str' parts"):
        flatten_content(["bare string"], backend="echo")
    with pytest.raises(RequestRejected, match="not int"):
        flatten_content(7, backend="echo")


def test_text_messages_make_every_content_a_string_and_keep_everything_else() -> None:
    messages: tuple[dict[str, Any], ...] = (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    )
    assert text_messages(messages, backend="any") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    assert text_messages([{"role": "assistant", "tool_calls": []}], backend="any")[0]["content"] == ""
    assert messages[1]["content"][0] == {"type": "text", "text": "a"}  # the input is not changed


# --- trim_at_stop -------------------------------------------------------------------------------
@given(st.text(max_size=40), stop_lists)
def test_trimmed_text_contains_no_stop_string_and_is_a_prefix(text: str, stops: list[str]) -> None:
    trimmed, hit = trim_at_stop(text, stops)
    assert text.startswith(trimmed)
    assert not any(stop and stop in trimmed for stop in stops)
    assert hit == any(stop and stop in text for stop in stops)
    if not hit:
        assert trimmed == text


@given(st.text(max_size=20), st.text(min_size=1, max_size=4), st.text(max_size=20))
def test_text_is_cut_right_before_the_first_stop(before: str, stop: str, after: str) -> None:
    if stop in before:
        return  # the stop occurs earlier than where it was put; covered by the property above
    assert trim_at_stop(before + stop + after, [stop]) == (before, True)


def test_the_earliest_stop_wins_whatever_the_order_of_the_list() -> None:
    assert trim_at_stop("one two three", ["three", "two"]) == ("one ", True)
    assert trim_at_stop("one two three", ["", "four"]) == ("one two three", False)


# --- split_reasoning ----------------------------------------------------------------------------
def test_a_leading_think_block_becomes_the_reasoning() -> None:
    assert split_reasoning("plain answer") == ("plain answer", None)
    assert split_reasoning("<think> hmm </think>\n\nfour") == ("four", "hmm")
    assert split_reasoning("\n <think>2 and 2 make 4</think>The answer is 4.") == (
        "The answer is 4.",
        "2 and 2 make 4",
    )
    assert split_reasoning("The answer is 4. <think>late</think>") == (
        "The answer is 4. <think>late</think>",
        None,
    )


def test_a_block_cut_off_by_the_output_limit_is_all_reasoning() -> None:
    assert split_reasoning("  <think>cut off by the limit") == ("", "cut off by the limit")


def test_a_block_opened_by_the_chat_template() -> None:
    assert split_reasoning("hmm</think>four", opened_by_prompt=True) == ("four", "hmm")
    assert split_reasoning("still thinking", opened_by_prompt=True) == ("", "still thinking")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


@given(st.text(max_size=30).filter(lambda t: "</think>" not in t), st.text(max_size=30))
def test_reasoning_and_answer_come_from_the_text(reasoning: str, answer: str) -> None:
    text = f"<think>{reasoning}</think>{answer}"
    got_answer, got_reasoning = split_reasoning(text)
    assert got_reasoning == reasoning.strip()
    assert got_answer == answer.lstrip()
