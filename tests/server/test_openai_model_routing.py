"""The openai backend routes each request by its model to the upstreams serving it: two real
``transformers serve`` upstreams, each serving SmolLM2 under a different name (``model``, ``live``).

``transformers serve FOLDER`` lists its model as the folder's path, so the second upstream serves
the same weights through a link with another name: two upstreams, two model names.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import packaged_model
from tests.helpers import chat_line, file_lines, submit, wait_for_status
from tests.live import LiveServer, start_server
from tests.upstreams import Upstream, start_upstream

pytestmark = [pytest.mark.model, pytest.mark.live]


@pytest.fixture
def two_models(tmp_path: Path) -> Iterator[tuple[list[Upstream], list[str]]]:
    first = packaged_model.converted()
    second = tmp_path / "smol-second"
    second.symlink_to(first, target_is_directory=True)
    upstreams = [
        start_upstream(folder, tmp_path / f"upstream-{i}.log") for i, folder in enumerate((first, second))
    ]
    try:
        for upstream in upstreams:
            upstream.wait_ready()
        yield upstreams, [str(first), str(second)]
    finally:
        for upstream in upstreams:
            upstream.stop()


def test_each_request_goes_only_to_the_upstream_serving_its_model(
    two_models: tuple[list[Upstream], list[str]], tmp_path: Path
) -> None:
    upstreams, names = two_models
    flags = [arg for upstream in upstreams for arg in ("--upstream", upstream.url)]
    server: LiveServer = start_server(tmp_path / "storage", "--backend", "openai", *flags)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            listing = client.get("/v1/models").json()["data"]
            assert {entry["id"] for entry in listing} >= set(names)
            assert all(entry["backend"] == "openai" for entry in listing)
            for index, name in enumerate(names):
                before = [upstream.posts() for upstream in upstreams]
                lines = [
                    chat_line(f"q{i}", f"Name the number {i}.", model=name, max_tokens=4) for i in range(3)
                ]
                batch = wait_for_status(client, submit(client, lines)["id"], {"completed", "failed"}, 300)
                assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, batch
                for line in file_lines(client, batch["output_file_id"]):
                    assert line["response"]["body"]["model"] == name
                after = [upstream.posts() for upstream in upstreams]
                grown = [b - a for a, b in zip(before, after, strict=True)]
                assert grown[index] == 3 and grown[1 - index] == 0, grown
    finally:
        server.stop()
