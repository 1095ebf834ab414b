"""Result files: whole lines only, a torn last line cut off on recovery, usage read back."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.models import GenerationResult
from batchgen.core.requests.results import error_line, output_line
from batchgen.core.storage import OutputWriter, read_finished_lines
from tests.examples import examples


def test_a_torn_last_line_is_cut_off_and_complete_lines_are_read_back(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    writer = OutputWriter(path)
    result = GenerationResult(text="four", finish_reason="stop", prompt_tokens=7, completion_tokens=2)
    writer.append(output_line("a", "req_1", "/v1/chat/completions", "m", result, 0))
    writer.append(output_line("b", "req_2", "/v1/chat/completions", "m", result, 0))
    writer.close()
    whole = path.read_bytes()
    with path.open("ab") as stream:  # what a crash in the middle of a write leaves
        stream.write(b'{"id": "batch_req_x", "custom_id": "c", "resp')

    finished = read_finished_lines(path)
    assert finished.custom_ids == ["a", "b"]
    assert (finished.prompt_tokens, finished.completion_tokens) == (14, 4)
    assert path.read_bytes() == whole


def test_error_lines_count_as_finished_without_usage(tmp_path: Path) -> None:
    path = tmp_path / "errors.jsonl"
    writer = OutputWriter(path)
    writer.append(error_line("x", "context_length_exceeded", "Prompt length 9 exceeds model context 4"))
    writer.close()
    assert json.loads(path.read_text())["error"]["code"] == "context_length_exceeded"
    finished = read_finished_lines(path)
    assert finished.custom_ids == ["x"] and finished.completion_tokens == 0


def test_missing_file_has_no_lines(tmp_path: Path) -> None:
    assert read_finished_lines(tmp_path / "never-written.jsonl").custom_ids == []


#: Text rich in what splits lines: every character ``str.splitlines`` breaks at, and any other.
_LINE_BREAKERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_TEXT = st.text(st.one_of(st.sampled_from(_LINE_BREAKERS), st.characters(exclude_categories=["Cs"])))


@settings(max_examples=examples(300), deadline=None)
@given(custom_ids=st.lists(_TEXT.filter(bool), min_size=1, max_size=5, unique=True), text=_TEXT)
def test_every_line_reads_back_as_one_record_however_it_is_split(custom_ids: list[str], text: str) -> None:
    """``splitlines()`` of a file of output and error lines (the openai SDK idiom) gives one
    record per request, each with its custom_id and text intact, as bytes or as text."""
    result = GenerationResult(text=text, finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    data = b"".join(
        output_line(custom_id, "req", "/v1/chat/completions", "m", result, 0)
        + error_line(custom_id, "internal_error", text)
        for custom_id in custom_ids
    )
    for lines in (data.decode("utf-8").splitlines(), data.splitlines()):
        records = [json.loads(line) for line in lines]
        assert [record["custom_id"] for record in records] == [c for c in custom_ids for _ in (0, 1)]
        assert all(
            record["response"]["body"]["choices"][0]["message"]["content"] == text for record in records[::2]
        )
        assert all(record["error"]["message"] == text for record in records[1::2])
