"""Streamed validation (``streamed_validation``) says exactly what ``validate_batch_file`` says.

Files of good lines, bad lines, blank lines and repeated ``custom_id`` values (Hypothesis), cut
into chunks at any byte: the first pass and, where it asks for one, the exact pass give the same
summary, or the same problems with the same 1-based line numbers and the same total, as the
whole-file validation; and the first pass keeps 8 bytes per id, not the ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.errors import InvalidBatchFile
from batchgen.core.files.batch_file import MAX_REPORTED_LINES, BatchFileSummary, validate_batch_file
from batchgen.core.files.streamed_validation import StreamedValidation, validate_exactly
from tests.examples import examples
from tests.helpers import chat_line, jsonl

_LINES = st.one_of(
    st.integers(0, 30).map(lambda i: chat_line(f"id-{i}", f"question {i}")),  # ids repeat sometimes
    st.integers(0, 30).map(lambda i: chat_line(f"id-{i}", temperature=-1)),  # a bad field
    st.just(b"{not json"),
    st.just(b""),  # blank
    st.just(b"\xff\xfe"),  # not UTF-8
    st.integers(0, 5).map(
        lambda i: {
            "custom_id": f"id-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x"},
        }
    ),  # another url
)


def _outcome(run: object) -> tuple[str, object]:
    try:
        summary = run()  # type: ignore[operator]
    except InvalidBatchFile as exc:
        return "invalid", ([(p.line, p.message, p.left_out) for p in exc.problems], exc.total_problems)
    assert isinstance(summary, BatchFileSummary)
    return "valid", (summary.line_count, summary.url)


def _streamed(data: bytes, cuts: list[int]) -> BatchFileSummary:
    points = sorted({min(cut, len(data)) for cut in cuts})
    chunks = [data[start:stop] for start, stop in zip([0, *points], [*points, len(data)], strict=True)]
    first = StreamedValidation()
    for chunk in chunks:
        first.feed(chunk)
    found = first.finish()
    if isinstance(found, BatchFileSummary):
        return found
    return validate_exactly(chunks, None, found)


@settings(max_examples=examples(150), deadline=None)
@given(lines=st.lists(_LINES, max_size=40), cuts=st.lists(st.integers(0, 4000), max_size=8))
def test_streamed_validation_says_what_the_whole_file_validation_says(
    lines: list[object], cuts: list[int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    data = jsonl(*lines)
    path = tmp_path_factory.mktemp("file") / "input.jsonl"
    path.write_bytes(data)
    assert _outcome(lambda: _streamed(data, cuts)) == _outcome(lambda: validate_batch_file(str(path)))


def test_a_valid_file_needs_one_pass_and_keeps_hashes_not_ids(tmp_path: Path) -> None:
    data = jsonl(*[chat_line(f"request-{i}") for i in range(5000)])
    first = StreamedValidation()
    for start in range(0, len(data), 4096):
        first.feed(data[start : start + 4096])
    assert first.finish() == BatchFileSummary(line_count=5000, url="/v1/chat/completions")
    ids = first._ids
    assert sum(len(bucket) for bucket in ids.accepted) == 5000
    assert all(bucket.itemsize == 8 for bucket in ids.accepted)


def test_a_duplicate_far_apart_is_found_with_its_line_number() -> None:
    lines = [chat_line(f"request-{i}") for i in range(3000)] + [chat_line("request-7")]
    data = jsonl(*lines)
    with pytest.raises(InvalidBatchFile) as caught:
        _streamed(data, [1000, 50_000, 100_001])
    assert [(problem.line, problem.message) for problem in caught.value.problems] == [
        (3001, "duplicate custom_id 'request-7'")
    ]


@settings(max_examples=examples(100), deadline=None)
@given(
    lines=st.lists(
        st.tuples(st.integers(0, 6), st.booleans()).map(
            lambda pair: chat_line(f"id-{pair[0]}", temperature=-1 if pair[1] else 0.5)
        ),
        min_size=2,
        max_size=25,
    ),
    cuts=st.lists(st.integers(0, 4000), max_size=4),
)
def test_every_repeated_custom_id_is_reported_whatever_else_is_wrong_with_either_line(
    lines: list[dict[str, object]], cuts: list[int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A line whose id an earlier line has (that line valid or not) says so beside its other
    problems; a line whose id is new does not, both ways the file is validated."""
    data = jsonl(*lines)
    path = tmp_path_factory.mktemp("file") / "input.jsonl"
    path.write_bytes(data)
    seen: set[object] = set()
    repeated = set()
    for number, line in enumerate(lines, start=1):
        if line["custom_id"] in seen:
            repeated.add(number)
        seen.add(line["custom_id"])
    for validate in (lambda: validate_batch_file(str(path)), lambda: _streamed(data, cuts)):
        try:
            validate()
        except InvalidBatchFile as exc:
            duplicates = {
                problem.line for problem in exc.problems if "duplicate custom_id" in problem.message
            }
            listed = {problem.line for problem in exc.problems}  # the first MAX_REPORTED_LINES
            last = max(listed) if len(listed) == MAX_REPORTED_LINES else len(lines)
        else:
            duplicates, last = set(), len(lines)
        assert duplicates == {number for number in repeated if number <= last}
