"""Rewriting a result file in input order (``output_order.rewrite_in_input_order``).

Whatever order the requests finished in, with failures among them and lines that never ran (a
cancel), the rewritten file holds exactly the appended file's lines, each once, in input order;
rewriting it again changes nothing; a file that does not map onto the input is left untouched; and
a million lines are put in order with memory far below their size.
"""

from __future__ import annotations

import json
import os
import random
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.batches.output_order import (
    UnorderableResults,
    check_output_order,
    ordering_path,
    rewrite_in_input_order,
)
from batchgen.core.errors import InvalidRequest
from batchgen.core.requests.results import error_line
from tests.examples import examples


def _input(folder: Path, custom_ids: list[str]) -> Path:
    path = folder / "input.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        for number, custom_id in enumerate(custom_ids):
            body = {"model": "m", "messages": [{"role": "user", "content": f"q{number}"}]}
            line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
            stream.write(json.dumps(line) + ("\n\n" if number % 7 == 3 else "\n"))  # blank lines too
    return path


def _result(custom_id: str, failed: bool) -> bytes:
    if failed:
        return error_line(custom_id, "backend_error", "it failed", "/v1/chat/completions")
    body = {"choices": [{"message": {"content": f"answer to {custom_id}"}}], "usage": {"prompt_tokens": 1}}
    record = {
        "id": f"req-{custom_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "body": body},
    }
    return json.dumps(record).encode() + b"\n"


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data(), count=st.integers(1, 60))
def test_any_finishing_order_ends_in_input_order_with_the_same_lines(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, count: int
) -> None:
    folder = tmp_path_factory.mktemp("rewrite")
    custom_ids = data.draw(
        st.lists(st.text(min_size=1, max_size=8), min_size=count, max_size=count, unique=True), "ids"
    )
    input_path = _input(folder, custom_ids)
    finished = data.draw(st.permutations(range(count)), "finishing order")
    ran = data.draw(st.integers(0, count), "lines written (fewer: cancelled)")
    failed = data.draw(st.sets(st.sampled_from(range(count))), "failed")
    result = folder / "out.jsonl"
    appended = [_result(custom_ids[n], n in failed) for n in finished[:ran]]
    result.write_bytes(b"".join(appended))

    done = rewrite_in_input_order(input_path, result)

    ordered = result.read_bytes().splitlines(keepends=True)
    assert sorted(ordered) == sorted(appended)  # exactly the appended lines, each once
    positions = [custom_ids.index(json.loads(line)["custom_id"]) for line in ordered]
    assert positions == sorted(positions)  # in input order
    assert done.lines == ran and done.bytes == sum(map(len, appended))
    assert not ordering_path(result).exists()
    again = result.read_bytes()
    rewrite_in_input_order(input_path, result)
    assert result.read_bytes() == again  # an ordered file stays as it is


def test_a_missing_result_file_is_nothing_to_do(tmp_path: Path) -> None:
    assert rewrite_in_input_order(_input(tmp_path, ["a"]), tmp_path / "none.jsonl").lines == 0
    assert not (tmp_path / "none.jsonl").exists()


@pytest.mark.parametrize(
    "lines", [[b"x", b"a"], [b"a", b"a"]], ids=["custom_id not in the input", "a custom_id twice"]
)
def test_results_that_do_not_map_onto_the_input_are_left_untouched(
    tmp_path: Path, lines: list[bytes]
) -> None:
    input_path = _input(tmp_path, ["a", "b"])
    result = tmp_path / "out.jsonl"
    original = b"".join(_result(custom_id.decode(), False) for custom_id in lines)
    result.write_bytes(original)
    with pytest.raises(UnorderableResults):
        rewrite_in_input_order(input_path, result)
    assert result.read_bytes() == original
    assert not ordering_path(result).exists()


def test_custom_ids_with_one_hash_are_told_apart_by_reading_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import batchgen.core.batches.output_order as module

    monkeypatch.setattr(module, "hash", lambda _text: 7, raising=False)  # every custom_id collides
    custom_ids = [f"id{n}" for n in range(30)]
    input_path = _input(tmp_path, custom_ids)
    result = tmp_path / "out.jsonl"
    shuffled = custom_ids[:]
    random.Random(3).shuffle(shuffled)
    result.write_bytes(b"".join(_result(custom_id, False) for custom_id in shuffled))
    rewrite_in_input_order(input_path, result)
    assert [json.loads(line)["custom_id"] for line in result.read_bytes().splitlines()] == custom_ids


@pytest.mark.parametrize("value", ["completion", "input"])
def test_the_two_orders_are_accepted(value: str) -> None:
    assert check_output_order(value) == value


@pytest.mark.parametrize("value", ["INPUT", "", None, 0, ["input"], "input "])
def test_anything_else_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_output_order(value)
    assert refused.value.param == "output_order"


MILLION = 1_000_000


def _million_lines(folder: Path) -> tuple[Path, Path, int]:
    """A 1,000,000-line input and its results appended in a shuffled order, as a batch leaves
    them; returns both paths and the results' size."""
    input_path = folder / "input.jsonl"
    with open(input_path, "w", encoding="ascii", buffering=1 << 20) as stream:
        for number in range(MILLION):
            stream.write(
                f'{{"custom_id":"request-{number}","method":"POST","url":"/v1/chat/completions",'
                f'"body":{{"model":"m","messages":[{{"role":"user","content":"question {number}"}}]}}}}\n'
            )
    order = list(range(MILLION))
    random.Random(22).shuffle(order)
    result = folder / "out.jsonl"
    filler = "lorem ipsum dolor sit amet " * 12
    with open(result, "w", encoding="ascii", buffering=1 << 20) as stream:
        for number in order:
            stream.write(
                f'{{"id":"batch_req_{number:024d}","custom_id":"request-{number}","response":{{"status_code":200,'
                f'"request_id":"r{number}","body":{{"object":"chat.completion","model":"m","choices":[{{"index":0,'
                f'"message":{{"role":"assistant","content":"{filler}{number}"}},"finish_reason":"stop"}}],'
                f'"usage":{{"prompt_tokens":5,"completion_tokens":60,"total_tokens":65}}}}}},"error":null}}\n'
            )
    del order
    return input_path, result, result.stat().st_size


@pytest.mark.slow
def test_a_million_lines_are_ordered_with_memory_far_below_their_size(tmp_path: Path) -> None:
    input_path, result, size = _million_lines(tmp_path)
    tracemalloc.start()
    try:
        done = rewrite_in_input_order(input_path, result)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done.lines == MILLION and done.bytes == size == result.stat().st_size
    # about 60 bytes a line (the line index, the hash table, where each result lies): holding the
    # results themselves would take their whole size
    assert peak < size / 4, (peak, size)
    with open(result, "rb") as stream:
        for number, raw in enumerate(stream):
            assert raw.startswith(b'{"id":"batch_req_%024d","custom_id":"request-%d"' % (number, number))
    assert number == MILLION - 1
    assert os.path.getsize(input_path) > 0
