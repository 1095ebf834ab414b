"""Result files: whole lines only, a torn last line cut off on recovery, usage read back."""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.core.models import GenerationResult
from batchgen.core.results import error_line, output_line
from batchgen.core.storage import OutputWriter, read_finished_lines


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
