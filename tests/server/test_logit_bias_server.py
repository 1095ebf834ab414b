"""``logit_bias`` end to end on a ``batchgen-server`` with the transformers backend (tiny model):
the upload accepts it, the worker process applies it (a +100 bias on one token makes every
generated token that one), a token id outside the vocabulary is that line's error line, and a
field the backend does not run (tools) is refused at upload naming the line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers import api_error, chat_line, file_lines, jsonl, post_file, submit, wait_for_status
from tests.live import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.live]


def test_the_transformers_server_applies_logit_bias(
    server_factory: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = server_factory("--backend", "transformers", "--model", str(tiny_model), "--max-batch-size", "4")
    token = 1234
    lines = [
        chat_line("plain", max_tokens=4, temperature=0),
        chat_line("biased", max_tokens=4, temperature=0, logit_bias={str(token): 100}),
        chat_line("outside", max_tokens=4, temperature=0, logit_bias={"999999999": 5}),
    ]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        refused = api_error(post_file(client, jsonl(chat_line("p", tool_choice="required"))), 400)
        assert "line 1: 'body.tool_choice'" in str(refused["message"])
        batch = submit(client, lines)
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=120)
        output = {line["custom_id"]: line for line in file_lines(client, done["output_file_id"])}
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tiny_model).decode([token] * 4, skip_special_tokens=True)
    biased = output["biased"]["response"]["body"]["choices"][0]["message"]["content"]
    plain = output["plain"]["response"]["body"]["choices"][0]["message"]["content"]
    assert biased == expected != plain
    assert output["outside"]["error"]["code"] == "invalid_request"
    assert "vocabulary" in output["outside"]["error"]["message"]
