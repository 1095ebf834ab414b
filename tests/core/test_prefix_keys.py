"""Prompt prefix keys (``prefix_keys``) and the grouping of a batch's lines by them (``prefix_groups``).

The keys: requests that agree on their model and the first ``PREFIX_CHARS`` characters of their
stream have equal keys, whatever follows; requests that differ there have different ones (for
generated inputs, where a 64-bit collision would be a bug, not luck); a batch line's key (read by
the indexer) equals the key the ``openai`` backend computes from the request it sends; and the
benchmark workload (many prefixes of 400 tokens, 20 items each, shuffled) gets exactly one key per
prefix. The grouping: a permutation that makes each key's positions contiguous, groups in order of
first appearance, each in its own order, and the identity when no key repeats.
"""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.files.batch_file import index_batch_file
from batchgen.core.requests.prefix_keys import PREFIX_CHARS, chat_prefix_key, line_prefix_key, prefix_key
from batchgen.core.requests.responses_api import chat_messages
from batchgen.core.requests.schema import message_dicts, read_envelope
from batchgen.core.scheduling.prefix_groups import grouped_by_prefix

texts = st.text(st.characters(codec="utf-8"), max_size=40)
roles = st.sampled_from(["system", "user", "assistant", "developer"])
messages_of = st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), min_size=1, max_size=4)


def _line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


@given(shared=st.text(min_size=PREFIX_CHARS, max_size=PREFIX_CHARS + 20), tails=st.lists(texts, min_size=2))
def test_prompts_that_share_their_first_characters_share_a_key(shared: str, tails: list[str]) -> None:
    keys = {prefix_key("m", prompt=shared + tail) for tail in tails}
    assert len(keys) == 1
    chats = {chat_prefix_key("m", [{"role": "user", "content": shared + tail}]) for tail in tails}
    assert len(chats) == 1
    system = {
        chat_prefix_key("m", [{"role": "system", "content": shared}, {"role": "user", "content": tail}])
        for tail in tails
    }
    assert len(system) == 1, "a long system prompt decides the key, whatever item follows it"


@given(first=messages_of, second=messages_of)
def test_chats_that_differ_in_their_leading_characters_have_different_keys(
    first: list[dict[str, str]], second: list[dict[str, str]]
) -> None:
    """Short conversations (under PREFIX_CHARS in all) have equal keys exactly when they are equal."""
    assert (chat_prefix_key("m", first) == chat_prefix_key("m", second)) == (first == second)


@given(text=texts, role=roles)
def test_separators_cannot_be_forged_and_the_model_counts(text: str, role: str) -> None:
    one = [{"role": role, "content": text + "\x1f\x1euser\x1fmore"}]
    two = [{"role": role, "content": text}, {"role": "user", "content": "more"}]
    assert chat_prefix_key("m", one) != chat_prefix_key("m", two)
    assert chat_prefix_key("a", two) != chat_prefix_key("b", two)
    assert prefix_key("m", prompt=text) != chat_prefix_key("m", [{"role": "user", "content": text}])
    assert chat_prefix_key("m", [{"role": role, "content": text, "name": "x"}]) != chat_prefix_key(
        "m", [{"role": role, "content": text}]
    )


def test_content_parts_count_as_their_text_and_other_parts_as_json() -> None:
    plain = [{"role": "user", "content": "look at this"}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "look at "}, {"type": "text", "text": "this"}]}
    ]
    assert chat_prefix_key("m", plain) == chat_prefix_key("m", parts)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}]
    other = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b"}}]}]
    assert chat_prefix_key("m", image) != chat_prefix_key("m", other)


def test_embeddings_and_unreadable_lines_have_no_key() -> None:
    assert prefix_key("m") is None
    assert line_prefix_key(_line("e", {"model": "m", "input": "hello"}, "/v1/embeddings")) is None
    assert line_prefix_key(b"{not json") is None
    assert line_prefix_key(b'{"url": "/v1/chat/completions", "body": {"messages": 3}}') is None


@given(messages=messages_of, model=st.sampled_from(["m", "other"]))
def test_a_line_s_key_is_the_key_of_the_messages_its_backend_is_sent(
    messages: list[dict[str, str]], model: str
) -> None:
    raw = _line("a", {"model": model, "messages": messages, "max_tokens": 3})
    sent = message_dicts(read_envelope(raw))  # what the executor hands the backend
    assert line_prefix_key(raw) == prefix_key(model, messages=sent)


@given(
    instructions=st.one_of(st.none(), st.text(min_size=1, max_size=30)), text=st.text(min_size=1, max_size=30)
)
def test_a_responses_line_has_the_key_of_the_chat_it_runs_as(instructions: str | None, text: str) -> None:
    body: dict[str, Any] = {"model": "m", "input": text}
    if instructions is not None:
        body["instructions"] = instructions
    raw = _line("r", body, "/v1/responses")
    assert line_prefix_key(raw) == prefix_key("m", messages=chat_messages(instructions, text))


@given(prompt=st.text(max_size=60))
def test_a_completions_line_has_the_key_of_its_prompt(prompt: str) -> None:
    raw = _line("c", {"model": "m", "prompt": prompt}, "/v1/completions")
    assert line_prefix_key(raw) == prefix_key("m", prompt=prompt)


def _prefix_text(rng: random.Random, words: int) -> str:
    vocabulary = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_the_benchmark_workload_gets_one_key_per_prefix(tmp_path: Path) -> None:
    """200 prefixes of about 400 tokens (400 words), 20 items each, shuffled; the prefixes as a
    system prompt for half the file and as the start of the one user message for the other half:
    the index gives exactly one key per (prefix, layout) and every key holds its 20 lines."""
    rng = random.Random(7)
    prefixes = [f"Task {number}. " + _prefix_text(rng, 400) for number in range(200)]
    lines: list[tuple[int, bytes]] = []
    for number, prefix in enumerate(prefixes):
        for item in range(20):
            question = f"Item {item}: {_prefix_text(rng, 12)}?"
            if number % 2:
                messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
            else:
                messages = [{"role": "user", "content": prefix + "\n\n" + question}]
            lines.append((number, _line(f"p{number}-{item}", {"model": "default", "messages": messages})))
    rng.shuffle(lines)
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join(raw for _, raw in lines) + b"\n")
    index = index_batch_file(str(path))
    assert index.prefixes is not None and len(index.prefixes) == 4000
    key_of_prefix: dict[int, set[int]] = {}
    for (number, _), key in zip(lines, index.prefixes, strict=True):
        key_of_prefix.setdefault(number, set()).add(key)
    assert all(len(keys) == 1 for keys in key_of_prefix.values()), "a prefix has two keys"
    assert len({next(iter(keys)) for keys in key_of_prefix.values()}) == 200, "two prefixes share a key"


def test_a_file_without_shared_prefixes_keeps_its_order(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    body = lambda i: {"model": "default", "messages": [{"role": "user", "content": f"Question {i}: 2+2?"}]}  # noqa: E731
    path.write_bytes(b"".join(_line(f"q{i}", body(i)) + b"\n" for i in range(300)))
    index = index_batch_file(str(path))
    assert index.prefixes is not None and len(set(index.prefixes)) == 300
    pending = array("l", range(300))
    assert grouped_by_prefix(pending, index.prefixes) is pending


def test_an_embeddings_file_records_no_keys(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(
        b"".join(_line(f"e{i}", {"model": "m", "input": "x"}, "/v1/embeddings") + b"\n" for i in range(3))
    )
    assert index_batch_file(str(path)).prefixes is None


@given(
    keys=st.lists(st.integers(0, 6), max_size=60),
    data=st.data(),
    max_groups=st.integers(1, 8),
)
def test_grouping_is_a_permutation_with_each_key_contiguous(
    keys: list[int], data: st.DataObject, max_groups: int
) -> None:
    pending_list = data.draw(st.permutations(range(len(keys))), label="pending order")
    pending = array("l", pending_list)
    ordered = list(grouped_by_prefix(array("l", pending), keys, max_groups))
    assert sorted(ordered) == sorted(pending_list), "a line was lost or doubled"
    # the first max_groups distinct keys (in pending order) are grouped: each is one contiguous run,
    # the runs in order of first appearance, each in pending order
    grouped: list[int] = []
    for position in pending_list:
        if keys[position] not in grouped and len(grouped) < max_groups:
            grouped.append(keys[position])
    expected: list[int] = []
    placed: set[int] = set()
    for position in pending_list:
        key = keys[position]
        if key in grouped:
            if key not in placed:
                placed.add(key)
                expected.extend(p for p in pending_list if keys[p] == key)
        else:  # a key first seen after the cap: each of its lines keeps its place
            expected.append(position)
    assert ordered == expected


def test_grouping_without_repeats_is_the_identity() -> None:
    pending = array("l", [4, 2, 0, 1, 3])
    assert grouped_by_prefix(pending, [10, 11, 12, 13, 14]) is pending
    assert list(grouped_by_prefix(array("l", [4, 2, 0, 1, 3]), [7, 8, 7, 9, 8])) == [4, 1, 2, 0, 3]
