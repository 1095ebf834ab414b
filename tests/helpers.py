"""Test helpers shared by every test module: request lines, JSONL files, and the REST calls.

The HTTP helpers take any ``httpx.Client`` pointed at a server's base URL: a client of a live
``batchgen-server`` process (``tests.live``) or Litestar's in-process ``TestClient`` over the
real app (the ``api`` fixtures in ``tests/conftest.py``), which is an ``httpx.Client`` too.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: Statuses a batch never leaves.
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


def chat_line(custom_id: str, content: object = "What is 2+2?", **body: object) -> dict[str, Any]:
    """One ``/v1/chat/completions`` request line; ``content`` is a string or a list of parts, and
    ``body`` adds or replaces body fields. The model is "default", the name every server serves."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "default", "messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(custom_id: str, prompt: str, **body: object) -> dict[str, Any]:
    """One ``/v1/completions`` request line."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"prompt": prompt, **body},
    }


def jsonl(*lines: object) -> bytes:
    """The lines as JSONL; a ``bytes`` line is taken as it is (for malformed input)."""
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def write_jsonl(path: Path, lines: Iterable[object]) -> Path:
    """Write ``lines`` to ``path`` as JSONL and return the path."""
    path.write_bytes(jsonl(*lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file, parsed; a missing file has none."""
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


_CACHED_TOKENS = re.compile(rb'"cached_tokens":\d+')


def as_replayed(body: bytes) -> bytes:
    """A first run's response body (its JSON bytes) as the result cache replays it: the same bytes,
    but for usage's ``cached_tokens``, which becomes every prompt token of the answer (none of the
    prompt was computed again). An embeddings body, which has no such field, stays as it is."""
    matches = list(_CACHED_TOKENS.finditer(body))
    if not matches:
        return body
    usage = json.loads(body)["usage"]
    prompt = usage["input_tokens"] if "input_tokens" in usage else usage["prompt_tokens"]
    last = matches[-1]  # the usage's: the only one outside a string, and after every other member
    return body[: last.start()] + b'"cached_tokens":%d' % prompt + body[last.end() :]


def upload(
    client: httpx.Client,
    content: bytes | Path,
    purpose: str = "batch",
    *,
    filename: str = "input.jsonl",
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``POST /v1/files``; the response must be 200. ``content`` is the bytes or a file to send."""
    response = post_file(client, content, purpose, filename=filename, headers=headers)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def post_file(
    client: httpx.Client,
    content: bytes | Path,
    purpose: str = "batch",
    *,
    filename: str = "input.jsonl",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """``POST /v1/files`` with whatever it answers."""
    if isinstance(content, Path):
        filename, content = content.name, content.read_bytes()
    return client.post(
        "/v1/files", files={"file": (filename, content)}, data={"purpose": purpose}, headers=headers
    )


def create_batch(client: httpx.Client, file_id: str, endpoint: str = CHAT, **extra: object) -> dict[str, Any]:
    """``POST /v1/batches``; the response must be 200. ``extra`` adds body fields."""
    response = post_batch(client, file_id, endpoint, **extra)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def post_batch(client: httpx.Client, file_id: str, endpoint: str = CHAT, **extra: object) -> httpx.Response:
    """``POST /v1/batches`` with whatever it answers."""
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, **extra})


def submit(client: httpx.Client, lines: list[dict[str, Any]], **extra: object) -> dict[str, Any]:
    """Upload ``lines`` and create a batch over them on their endpoint; returns the new batch."""
    file_id = upload(client, jsonl(*lines))["id"]
    return create_batch(client, file_id, str(lines[0]["url"]), **extra)


def wait_for_status(
    client: httpx.Client, batch_id: str, statuses: Iterable[str], timeout_s: float = 60
) -> dict[str, Any]:
    """Poll the batch until its status is one of ``statuses``; fail after ``timeout_s``."""
    wanted = set(statuses)
    deadline = time.monotonic() + timeout_s
    batch: dict[str, Any] = {}
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in wanted:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not reach {wanted} in {timeout_s} s: {batch}")


def file_lines(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    """The parsed lines of a stored file (none for no file)."""
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.content.splitlines()]


def api_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped ``error`` object of a response that must have ``status``."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


#: The ``api_factory`` fixture (tests/conftest.py): in-process servers made from command-line flags.
ApiFactory = Callable[..., httpx.Client]


def read_terminal(controller: int) -> bytes:
    """Everything a child process writes to a pseudo-terminal, read from its ``controller`` end
    until the child closes its side; the controller is closed after."""
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the process has closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    return shown
