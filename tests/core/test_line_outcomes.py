"""The one rule that says whether a result line counts as completed or failed, and who counts by it.

A line fails exactly when it has an ``error``, has no ``response``, or its response's
``status_code`` is 400 or more, wherever it is kept. Drawn lines of every such shape, and lines
the service's own builders make, are classified so; a replica's line (``LineResult``) and the
counts one process reads back from its result files after a restart agree with it, for any mix of
completed and failed lines, whichever convention keeps the error lines.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.models import GenerationResult
from batchgen.core.requests.line_outcomes import LineOutcome, line_outcome, outcome
from batchgen.core.requests.results import body_output_line, error_line, output_line
from batchgen.core.storage import OutputWriter, read_finished_lines
from batchgen.core.work.shard_runner import LineResult
from batchgen.core.work.shards import ERRORS, OUTPUT
from tests.examples import examples

_ERRORS = st.fixed_dictionaries({"code": st.text(max_size=20), "message": st.text(max_size=40)})
_RESPONSES = st.fixed_dictionaries(
    {"status_code": st.integers(100, 599), "request_id": st.just("req_1"), "body": st.just({})}
)


@settings(max_examples=examples(300))
@given(response=st.none() | _RESPONSES, error=st.none() | _ERRORS, custom_id=st.text(max_size=20))
def test_a_line_fails_exactly_when_it_has_an_error_no_response_or_a_status_of_400_or_more(
    response: dict[str, Any] | None, error: dict[str, str] | None, custom_id: str
) -> None:
    raw = json.dumps({"id": "batch_req_1", "custom_id": custom_id, "response": response, "error": error})
    fails = error is not None or response is None or response["status_code"] >= 400
    expected = LineOutcome.FAILED if fails else LineOutcome.COMPLETED
    assert line_outcome(raw.encode() + b"\n") is expected
    assert outcome(None if response is None else response["status_code"], error) is expected


def test_the_lines_the_service_writes_are_classified_as_what_they_record() -> None:
    result = GenerationResult(text="four", finish_reason="stop", prompt_tokens=7, completion_tokens=2)
    computed = output_line("a", "req_1", "/v1/chat/completions", "m", result, 0)
    replayed = body_output_line("b", "req_2", b'{"object": "chat.completion"}', cached=True)
    failed = error_line("c", "context_length_exceeded", "Prompt length 90 exceeds model context 50")
    assert [line_outcome(line) for line in (computed, replayed, failed)] == [
        LineOutcome.COMPLETED,
        LineOutcome.COMPLETED,
        LineOutcome.FAILED,
    ]


def _line(index: int, fails: bool) -> bytes:
    if fails:
        return error_line(f"r{index}", "context_length_exceeded", "too long")
    return body_output_line(f"r{index}", f"req_{index}", b'{"object": "chat.completion"}')


@settings(max_examples=examples(100), deadline=None)
@given(mix=st.lists(st.booleans(), max_size=60), separate=st.booleans(), data=st.data())
def test_one_process_and_a_replica_count_any_mix_of_lines_alike(
    tmp_path_factory: pytest.TempPathFactory, mix: list[bool], separate: bool, data: st.DataObject
) -> None:
    """``separate``: OpenAI's convention, error lines in a file (segments) of their own; else the
    user guide's, error lines with the results. Either way the counts are what the lines record."""
    folder = tmp_path_factory.mktemp("files")
    lines = [_line(index, fails) for index, fails in enumerate(mix)]
    kinds = [ERRORS if fails and separate else OUTPUT for fails in mix]
    # one process: the lines written as the requests ended, read back after a restart
    writers = {OUTPUT: OutputWriter(folder / "output.jsonl"), ERRORS: OutputWriter(folder / "errors.jsonl")}
    for line, kind in zip(lines, kinds, strict=True):
        writers[kind].append(line)
    for writer in writers.values():
        writer.close()
    files = [read_finished_lines(folder / name) for name in ("output.jsonl", "errors.jsonl")]
    one_process = (sum(file.completed for file in files), sum(file.failed for file in files))
    # a replica: the same lines as its line runner hands them to the shard runner, in any order
    results = data.draw(st.permutations([LineResult(k, line) for k, line in zip(kinds, lines, strict=True)]))
    failed = sum(result.outcome is LineOutcome.FAILED for result in results)
    replica = (len(results) - failed, failed)
    assert one_process == replica == (mix.count(False), mix.count(True))
