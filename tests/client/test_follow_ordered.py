"""`follow_results` over a batch whose files are rewritten in input order when it ends.

The follower reads the file as it grows (completion order), stops reading while the batch is
`finalizing` or `cancelling`, and once it has ended reads the rewritten file again from the start:
whatever the finishing order and wherever the reads stopped, every line is handed out exactly once.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from batchgen.client._follow import ResultFollower, ResultTail


def _line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200}}).encode() + b"\n"


def _read(tail: ResultTail, content: bytes) -> list[str]:
    """What one read of ``content`` (the file now) hands out, as the server would answer it."""
    if tail.offset >= len(content):
        tail.start(416)
        return tail.feed(b'{"error": "range"}')
    tail.start(206)
    return tail.feed(content[tail.offset :])


@given(
    data=st.data(),
    count=st.integers(1, 40),
    ending=st.sampled_from(["completed", "cancelled"]),
)
def test_every_line_is_handed_out_once_across_the_rewrite(
    data: st.DataObject, count: int, ending: str
) -> None:
    order = data.draw(st.permutations(range(count)))
    ran = count if ending == "completed" else data.draw(st.integers(0, count))
    finished = [f"id-{n}" for n in order[:ran]]
    reads = sorted(data.draw(st.lists(st.integers(0, ran), max_size=5)))  # lines written at each poll
    follower = ResultFollower()
    handed: list[str] = []

    def poll(status: str, content: bytes) -> None:
        batch: dict[str, Any] = {"status": status, "output_file_id": "file-x", "output_order": "input"}
        for tail in follower.tails(batch):
            handed.extend(json.loads(line)["custom_id"] for line in _read(tail, content))

    for written in reads:
        poll("in_progress", b"".join(_line(custom_id) for custom_id in finished[:written]))
    appended = b"".join(_line(custom_id) for custom_id in finished)
    ordered = b"".join(_line(custom_id) for custom_id in sorted(finished, key=lambda c: int(c[3:])))
    if ran == count and data.draw(st.booleans(), "a read lands after the rename"):
        poll("in_progress", ordered)  # polled just before the last line, read after the rewrite
    # a poll may or may not see the batch while it is rewritten, and the rename may land between
    # that poll and its read
    for _ in range(data.draw(st.integers(0, 2), "polls while rewriting")):
        poll(
            "finalizing" if ending == "completed" else "cancelling",
            data.draw(st.sampled_from([appended, ordered])),
        )
    poll(ending, ordered)
    handed.extend(json.loads(line)["custom_id"] for line in follower.finish())
    assert sorted(handed) == sorted(finished)  # each once


def test_a_batch_in_completion_order_is_read_on_from_where_it_was() -> None:
    follower = ResultFollower()
    batch = {"status": "finalizing", "output_file_id": "f", "output_order": "completion"}
    (tail,) = follower.tails(batch)
    assert _read(tail, _line("a") + _line("b")) == [_line("a").decode().strip(), _line("b").decode().strip()]
    (tail,) = follower.tails({**batch, "status": "completed"})
    assert tail.offset == len(_line("a") + _line("b"))  # no re-read
