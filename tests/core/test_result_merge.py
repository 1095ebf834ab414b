"""The merged view's ranking (``result_merge.FamilyIndex``) over any family of result files: a
success beats a failure, the later batch wins between equals, a request with no line never ran,
and only complete lines count."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.batches.result_merge import FamilyIndex, Outcome
from tests.examples import examples

#: What one batch of the family wrote for one request: a success, an error line, or a response
#: whose status is an error (also a failure).
KINDS = ("ok", "error", "status_500")


def _line(custom_id: str, kind: str, batch: int) -> bytes:
    tag = f"{custom_id}@{batch}"
    if kind == "ok":
        record = {
            "id": tag,
            "custom_id": custom_id,
            "response": {"status_code": 200, "body": {}},
            "error": None,
        }
    elif kind == "error":
        record = {"id": tag, "custom_id": custom_id, "response": None, "error": {"code": "x", "message": "m"}}
    else:
        record = {
            "id": tag,
            "custom_id": custom_id,
            "response": {"status_code": 500, "body": {}},
            "error": None,
        }
    return json.dumps(record).encode() + b"\n"


@st.composite
def families(draw: st.DrawFn) -> tuple[list[str], list[dict[str, str]], list[list[str]]]:
    """Input ids, then per batch the kind written for each request it ran, and the order it ran them."""
    ids = [f"id-{i}" for i in range(draw(st.integers(1, 12)))]
    batches = []
    orders = []
    for _ in range(draw(st.integers(1, 4))):
        ran = draw(st.lists(st.sampled_from(ids), unique=True))
        batches.append({custom_id: draw(st.sampled_from(KINDS)) for custom_id in ran})
        orders.append(draw(st.permutations(ran)))
    return ids, batches, orders


@given(family=families(), torn=st.booleans())
@settings(max_examples=examples(200))
def test_the_merged_view_is_the_best_line_of_each_request_in_input_order(
    family: tuple[list[str], list[dict[str, str]], list[list[str]]], torn: bool
) -> None:
    ids, batches, orders = family
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        input_lines = [json.dumps({"custom_id": custom_id, "body": {}}).encode() + b"\n" for custom_id in ids]
        (root / "in.jsonl").write_bytes(b"\n".join(input_lines))  # a blank line between each
        paths = []
        for number, (kinds, order) in enumerate(zip(batches, orders, strict=True)):
            path = root / f"out-{number}.jsonl"
            data = b"".join(_line(custom_id, kinds[custom_id], number) for custom_id in order)
            path.write_bytes(
                data + (b'{"custom_id": "id-0", "respo' if torn else b"")
            )  # a line being written
            paths.append(path)
        paths.append(root / "missing.jsonl")  # a result file not made yet: no lines
        best: dict[str, bytes] = {}
        outcome: dict[str, Outcome] = {}
        for number, kinds in enumerate(batches):
            for custom_id, kind in kinds.items():
                rank = Outcome.SUCCEEDED if kind == "ok" else Outcome.FAILED
                if rank >= outcome.get(custom_id, Outcome.NOT_RUN):
                    outcome[custom_id], best[custom_id] = rank, _line(custom_id, kind, number)
        with FamilyIndex.build(root / "index.sqlite3", root / "in.jsonl", paths) as index:
            merged = b"".join(index.merged_chunks(chunk_bytes=100))
            assert merged == b"".join(best[custom_id] for custom_id in ids if custom_id in best)
            assert index.merged_size() == len(merged)
            counts = index.counts()
            for each in Outcome:
                assert counts[each] == sum(
                    1 for custom_id in ids if outcome.get(custom_id, Outcome.NOT_RUN) is each
                )
            data = (root / "in.jsonl").read_bytes()
            for wanted in ({Outcome.FAILED}, {Outcome.NOT_RUN}, {Outcome.FAILED, Outcome.NOT_RUN}):
                spans = list(index.input_spans(frozenset(wanted)))
                chosen = [data[offset : offset + length].rstrip(b"\n") for offset, length in spans]
                expected = [
                    line.rstrip(b"\n")
                    for custom_id, line in zip(ids, input_lines, strict=True)
                    if outcome.get(custom_id, Outcome.NOT_RUN) in wanted
                ]
                assert chosen == expected
        assert not (root / "index.sqlite3").exists(), "the index is deleted when closed"
