"""Following a batch's result files while the server writes them, for `follow_results`.

The server appends one JSON line per finished request to a batch's output file (and, for failed
requests, its error file) and serves what is there so far at `GET /v1/files/{id}/content`. A
`ResultTail` remembers how far into one file it has handed out lines, asks for the rest with a
`Range` header, and cuts what arrives into complete lines; an unfinished last line waits for the
next poll. A server that ignores `Range` sends the whole file again, and the tail skips the part
it has already read, so only the network pays for it, not memory.

A batch created with `output_order: "input"` has its files rewritten in input order when it
completes or is cancelled, so the bytes after `offset` are no longer the lines that followed:
its tails remember the custom_ids they handed out, read nothing while the batch is `finalizing`
or `cancelling` (the rewrite may be under way), and once it has ended read each file again from
the start, handing out only the lines not handed out before. A read sent just before the batch
ended may still get the rewritten file from `offset` on: its first piece is the end of some line,
not a line with a custom_id, and is dropped; its whole lines are real lines, remembered as any.

No I/O here: the clients get `following.poll()`, send each of `following.tails(batch)`'s
`tail.request()`, then call `start` with the status and `feed` with each chunk of the body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from batchgen.client import _requests as req
from batchgen.client._requests import RequestSpec
from batchgen.client._wait import check_poll_interval

__all__ = ["Following", "ResultFollower", "ResultTail", "follow_results"]

PARTIAL_CONTENT = 206
#: The statuses in which an ordered batch's files may be being rewritten, and those after it.
_REWRITING = frozenset({"finalizing", "cancelling"})
_REWRITTEN = frozenset({"completed", "cancelled"})


class ResultTail:
    """The lines of one growing file not handed out yet."""

    def __init__(self, file_id: str, *, remember: bool = False) -> None:
        """`remember`: keep the custom_ids handed out, for a file that `reread` reads again."""
        self.file_id = file_id
        self.offset = 0
        """Bytes handed out as lines so far; always just after a newline."""
        self._skip = 0
        self._pending = bytearray()
        self._seen: set[str] | None = set() if remember else None

    def reread(self) -> None:
        """The file was rewritten with its lines in another order: read it again from the start,
        handing out only lines whose custom_id was not handed out before."""
        self.offset = 0
        self._skip = 0
        self._pending.clear()

    def _hand_out(self, lines: list[str]) -> list[str]:
        if self._seen is None:
            return lines
        fresh: list[str] = []
        for line in lines:
            custom_id = _custom_id(line)
            if custom_id is None:  # the tail of a line: a read began in the rewritten file
                continue
            if custom_id in self._seen:  # custom_ids are unique in a batch: a line seen before
                continue
            self._seen.add(custom_id)
            fresh.append(line)
        return fresh

    def request(self) -> RequestSpec:
        """The request for everything after `offset`."""
        return req.file_content(self.file_id, self.offset)

    def start(self, status_code: int) -> None:
        """Begin reading a response to `request()` with this (accepted) status."""
        self._pending.clear()
        if status_code == PARTIAL_CONTENT:
            self._skip = 0  # the body starts at `offset`
        elif status_code == req.RANGE_NOT_SATISFIABLE:
            self._skip = -1  # nothing new; the body is not file content
        else:
            self._skip = self.offset  # the whole file: skip what was read before

    def feed(self, chunk: bytes) -> list[str]:
        """The complete lines that `chunk` (the next piece of the body) finishes."""
        if self._skip < 0:
            return []
        if self._skip:
            dropped = min(self._skip, len(chunk))
            self._skip -= dropped
            chunk = chunk[dropped:]
        self._pending += chunk
        end = self._pending.rfind(b"\n") + 1
        if not end:
            return []
        complete = bytes(self._pending[:end])
        del self._pending[:end]
        self.offset += end
        return self._hand_out(_lines(complete))

    def finish(self) -> list[str]:
        """The unfinished last line as a line of its own; for when the file will not grow."""
        rest = bytes(self._pending)
        self._pending.clear()
        self.offset += len(rest)
        return self._hand_out(_lines(rest))


class ResultFollower:
    """The tails of a batch's output file and, with `errors`, of its error file.

    A batch names its files only once it has them (the error file when a request first fails),
    so `tails` is asked again after each poll.
    """

    def __init__(self, *, errors: bool = False) -> None:
        self._keys = ("output_file_id", "error_file_id") if errors else ("output_file_id",)
        self._tails: dict[str, ResultTail] = {}
        self._reread = False

    def tails(self, batch: Mapping[str, Any]) -> list[ResultTail]:
        """The tails to read after this poll of the batch, output file first (none while an
        ordered batch's files may be being rewritten)."""
        ordered = batch.get("output_order") == "input"
        for key in self._keys:
            file_id = batch.get(key)
            if isinstance(file_id, str) and file_id and key not in self._tails:
                self._tails[key] = ResultTail(file_id, remember=ordered)
        if ordered and batch.get("status") in _REWRITING:
            return []
        if ordered and batch.get("status") in _REWRITTEN and not self._reread:
            self._reread = True
            for tail in self._tails.values():
                tail.reread()
        return [self._tails[key] for key in self._keys if key in self._tails]

    def finish(self) -> list[str]:
        """Every tail's unfinished last line; once the batch has ended and all was read."""
        return [line for tail in self._tails.values() for line in tail.finish()]


def follow_results(batch_id: str, *, poll_interval: float = 2.0, errors: bool = False) -> Following:
    """Yield the batch's output lines (JSON text) as the server writes them, until it has ended.

    Each poll fetches only the part of the output file not read yet. With `errors`, lines of
    the error file are yielded too. Ends once the batch is terminal and every line was yielded.
    """
    check_poll_interval(poll_interval)
    return Following(batch_id, poll_interval, ResultFollower(errors=errors))


class Following:
    """One `follow_results`: the batch to poll, how often, and the tails of its files."""

    def __init__(self, batch_id: str, poll_interval: float, follower: ResultFollower) -> None:
        self.batch_id = batch_id
        self.poll_interval = poll_interval
        self.follower = follower

    def poll(self) -> RequestSpec:
        """The request for the batch's current state."""
        return req.get_batch(self.batch_id)

    def tails(self, batch: Mapping[str, Any]) -> list[ResultTail]:
        """The files to read after this poll (see `ResultFollower.tails`)."""
        return self.follower.tails(batch)

    def finish(self) -> list[str]:
        """The unfinished last lines, once the batch has ended and all was read."""
        return self.follower.finish()


def _custom_id(line: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    return [line for line in (raw.rstrip("\r") for raw in text.split("\n")) if line.strip()]
