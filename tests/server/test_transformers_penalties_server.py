"""``frequency_penalty`` and ``presence_penalty`` end to end on a ``batchgen-server`` with the
transformers backend (tiny model): the upload accepts them from -2 to 2 (and refuses a value
outside, naming the line), and the worker process applies them. A +1.5 ``logit_bias`` on one token
makes every generated token that one; a penalty of 2 on top makes the second token another."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers import api_error, chat_line, file_lines, jsonl, post_file, submit, wait_for_status
from tests.live import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.live]

TOKEN = 1234


def test_the_transformers_server_applies_the_penalties(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = server_factory("--backend", "transformers", "--model", str(tiny_model), "--max-batch-size", "4")
    bias = {str(TOKEN): 1.5}
    lines = [
        chat_line("biased", max_tokens=4, temperature=0, logit_bias=bias),
        chat_line("frequency", max_tokens=4, temperature=0, logit_bias=bias, frequency_penalty=2),
        chat_line("presence", max_tokens=4, temperature=0, logit_bias=bias, presence_penalty=2),
    ]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        refused = api_error(
            post_file(client, jsonl(chat_line("ok"), chat_line("p", presence_penalty=-3))), 400
        )
        assert "line 2: 'body.presence_penalty'" in str(refused["message"])
        batch = submit(client, lines)
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=120)
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, done
        output = {line["custom_id"]: line for line in file_lines(client, done["output_file_id"])}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = {
        name: line["response"]["body"]["choices"][0]["message"]["content"] for name, line in output.items()
    }
    repeated = tokenizer.decode([TOKEN] * 4, skip_special_tokens=True)
    assert texts["biased"] == repeated
    for name in ("frequency", "presence"):
        assert texts[name] != repeated and texts[name].startswith(tokenizer.decode([TOKEN])), texts
