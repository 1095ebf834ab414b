"""What the mock tests' httpx.MockTransport serves: scripted replies and failures, and small
in-memory stand-ins for the REST API, with the input files and result lines they deal in.

`Script` answers with fixed replies in turn; `FailingThen` raises transport errors first;
`FakeServer` keeps files and batches (validating → in_progress → completed) for `submit_batch`;
`GrowingFile` is a batch whose output grows on every poll, for `follow_results`.
"""

from __future__ import annotations

import email.policy
import json
from collections.abc import Callable
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import httpx

Reply = tuple[int, Any] | tuple[int, Any, dict[str, str]]


class Script:
    """A handler answering with the given (status, json[, headers]) in turn; the last repeats."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        status, body = reply[0], reply[1]
        headers: dict[str, str] = reply[2] if len(reply) == 3 else {}
        if isinstance(body, bytes):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)


def error_body(message: str, code: str, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": "input_file_id", "code": code}}


FULL = error_body("Intake pool is full", "capacity_exceeded", "rate_limit_error")
UNAVAILABLE = error_body("Server unhealthy", "service_unavailable", "server_error")


def multipart_fields(request: httpx.Request) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data request: name -> (filename, content)."""
    header = b"Content-Type: " + request.headers["content-type"].encode() + b"\r\n\r\n"
    message = BytesParser(policy=email.policy.HTTP).parsebytes(header + request.content)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        content = part.get_payload(decode=True)
        assert isinstance(name, str) and isinstance(content, bytes)
        fields[name] = (part.get_filename(), content)
    return fields


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def requests_file(tmp_path: Path, url: str = "/v1/chat/completions", n: int = 3) -> Path:
    rows = []
    for i in range(n):
        body: dict[str, Any]
        if url == "/v1/completions":
            body = {"model": "m", "prompt": f"count to {i}"}
        else:
            body = {"model": "m", "messages": [{"role": "user", "content": f"count to {i}"}]}
        rows.append({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body})
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(rows))
    return path


class FakeServer:
    """In-memory files and batches behind the REST paths the client uses.

    A new batch is `validating`; each GET of it moves it along `lifecycle`. On reaching the
    final status it writes the output file: one result line per input line (and an error file
    if `fail_custom_ids` names any). An upload or create with an `Idempotency-Key` seen before
    returns the object the first one made.
    """

    def __init__(
        self,
        lifecycle: tuple[str, ...] = ("validating", "in_progress", "completed"),
        fail_custom_ids: frozenset[str] = frozenset(),
    ) -> None:
        self.lifecycle = lifecycle
        self.fail_custom_ids = fail_custom_ids
        self.files: dict[str, dict[str, Any]] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.polls: dict[str, int] = {}
        self.seen_statuses: list[str] = []
        self.create_bodies: list[dict[str, Any]] = []
        self.requests: list[httpx.Request] = []
        self.made_by_key: dict[str, dict[str, Any]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        method, parts = request.method, request.url.path.strip("/").split("/")
        key = request.headers.get("idempotency-key")
        if method == "POST" and key in self.made_by_key:
            return httpx.Response(200, json=self.made_by_key[key])
        response = self._route(request, method, parts)
        if method == "POST" and key is not None and response.status_code == 200:
            self.made_by_key[key] = response.json()
        return response

    def _route(self, request: httpx.Request, method: str, parts: list[str]) -> httpx.Response:
        if (method, parts) == ("POST", ["v1", "files"]):
            fields = multipart_fields(request)
            filename, content = fields["file"]
            file_obj = self._add_file(filename or "upload", content, fields["purpose"][1].decode())
            return httpx.Response(200, json=file_obj)
        if method == "GET" and parts[:2] == ["v1", "files"] and len(parts) == 4:
            if parts[2] not in self.contents:
                return httpx.Response(404, json=error_body("No such file", "not_found"))
            return httpx.Response(200, content=self.contents[parts[2]])
        if (method, parts) == ("POST", ["v1", "batches"]):
            body = json.loads(request.content)
            self.create_bodies.append(body)
            batch_id = f"batch_{len(self.batches) + 1}"
            batch = {
                "id": batch_id,
                "object": "batch",
                "endpoint": body["endpoint"],
                "input_file_id": body["input_file_id"],
                "status": "validating",
                "output_file_id": None,
                "error_file_id": None,
            }
            self.batches[batch_id] = batch
            self.polls[batch_id] = 0
            return httpx.Response(200, json=batch)
        if method == "GET" and parts[:2] == ["v1", "batches"] and len(parts) == 3:
            return httpx.Response(200, json=self._poll(parts[2]))
        return httpx.Response(404, json=error_body(f"no route {method} {parts}", "not_found"))

    def _add_file(self, filename: str, content: bytes, purpose: str) -> dict[str, Any]:
        file_id = f"file-{len(self.files) + 1}"
        obj = {"id": file_id, "object": "file", "bytes": len(content), "filename": filename}
        self.files[file_id] = obj | {"purpose": purpose}
        self.contents[file_id] = content
        return self.files[file_id]

    def _poll(self, batch_id: str) -> dict[str, Any]:
        batch = self.batches[batch_id]
        step = min(self.polls[batch_id], len(self.lifecycle) - 1)
        self.polls[batch_id] += 1
        status = self.lifecycle[step]
        if status != batch["status"] or not self.seen_statuses:
            self.seen_statuses.append(status)
        batch["status"] = status
        if step == len(self.lifecycle) - 1 and batch["output_file_id"] is None:
            self._finish(batch)
        return batch

    def _finish(self, batch: dict[str, Any]) -> None:
        outputs, errors = [], []
        for line in self.contents[batch["input_file_id"]].splitlines():
            custom_id = json.loads(line)["custom_id"]
            if custom_id in self.fail_custom_ids:
                error = {"code": "context_length_exceeded", "message": "too long"}
                errors.append({"custom_id": custom_id, "response": None, "error": error})
            else:
                body = {"object": batch["endpoint"], "choices": [{"text": f"answer {custom_id}"}]}
                response = {"status_code": 200, "body": body}
                outputs.append({"custom_id": custom_id, "response": response, "error": None})
        batch["output_file_id"] = self._add_file("out.jsonl", jsonl(outputs), "batch_output")["id"]
        if errors:
            error_file = self._add_file("err.jsonl", jsonl(errors), "batch_output")
            batch["error_file_id"] = error_file["id"]
        if batch["status"] == "failed":
            batch["errors"] = {"data": [{"code": "batch_failed", "message": "worker crashed"}]}


def raising(exc: Exception) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


class FailingThen(Script):
    """Raises each of `failures` in turn (the request got no response), then answers `reply`."""

    def __init__(self, failures: list[Exception], reply: Reply) -> None:
        super().__init__(reply)
        self.failures = list(failures)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.failures:
            self.requests.append(request)
            raise self.failures.pop(0)
        return super().__call__(request)


def batch_script(*statuses: str, **final: Any) -> Script:
    replies: list[Reply] = [(200, {"id": "batch_1", "status": s}) for s in statuses[:-1]]
    replies.append((200, {"id": "batch_1", "status": statuses[-1], **final}))
    return Script(*replies)


def counted_script(*steps: tuple[str, int, int]) -> Script:
    """Polls of batch_1 going through (status, completed, failed) of 4 requests."""
    replies: list[Reply] = []
    for status, completed, failed in steps:
        counts = {"total": 4, "completed": completed, "failed": failed}
        replies.append((200, {"id": "batch_1", "status": status, "request_counts": counts}))
    return Script(*replies)


STEPS = (("validating", 0, 0), ("in_progress", 1, 0), ("in_progress", 2, 1), ("completed", 3, 1))


class GrowingFile:
    """batch_1 and its output (and error) file, which grow by a piece on every poll.

    `ranges` says whether content requests honour `Range` (206, or 416 past the end); when not,
    the whole file is sent each time.
    """

    def __init__(self, pieces: list[bytes], *, ranges: bool, errors: bytes = b"") -> None:
        self.pieces = pieces
        self.ranges = ranges
        self.errors = errors
        self.polls = 0
        self.range_headers: list[str | None] = []

    def output(self) -> bytes:
        return b"".join(self.pieces[: self.polls])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/batches/batch_1":
            self.polls += 1
            ended = self.polls >= len(self.pieces)
            batch = {"id": "batch_1", "status": "completed" if ended else "in_progress"}
            batch["output_file_id"] = "file-out"
            if self.errors:
                batch["error_file_id"] = "file-err"
            return httpx.Response(200, json=batch)
        content = self.output() if path == "/v1/files/file-out/content" else self.errors
        header = request.headers.get("range")
        self.range_headers.append(header)
        if not (self.ranges and header):
            return httpx.Response(200, content=content)
        start = int(header.removeprefix("bytes=").removesuffix("-"))
        if start >= len(content):
            return httpx.Response(416, json=error_body("Range not satisfiable", "range"))
        return httpx.Response(206, content=content[start:])


def result(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "error": None}).encode() + b"\n"


PIECES = [
    result("a") + result("b")[:7],  # the second line is cut in half
    result("b")[7:],
    b"",
    result("c") + result("d"),
]


def output_custom_ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]
