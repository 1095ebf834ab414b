"""The batch input files the benchmarks run: ``count`` chat requests for the default model, one
question each, with the body fields a benchmark adds per line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_chat_input(
    path: Path, count: int, extra_body: Callable[[int], dict[str, Any]] | None = None
) -> None:
    """Write ``count`` lines ``request-0`` … to ``path``; ``extra_body(i)`` adds fields to line i's body."""
    with path.open("w") as stream:
        for i in range(count):
            body: dict[str, Any] = {
                "model": "default",
                "messages": [{"role": "user", "content": f"Question {i}: what is 2+2?"}],
            }
            if extra_body is not None:
                body.update(extra_body(i))
            request = {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
            stream.write(json.dumps(request) + "\n")
