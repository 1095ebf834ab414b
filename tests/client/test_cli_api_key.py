"""The `batchgen` command and API keys: `--api-key`, else $BATCHGEN_API_KEY, else $OPENAI_API_KEY;
a refused key is a clear message and exit status 5 at once, never a retry loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from batchgen.client.cli import EXIT_OK, EXIT_UNAUTHORIZED, build_parser
from tests.keys import create_key
from tests.live import LiveServer, start_server

pytestmark = pytest.mark.live
KEY_ENVS = ("BATCHGEN_API_KEY", "OPENAI_API_KEY", "BATCHGEN_BASE_URL")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str, str]]:
    """A server with two keys of different tenants."""
    storage = tmp_path_factory.mktemp("cli-keys") / "storage"
    storage.mkdir()
    _, alice = create_key(storage, "alice")
    _, bob = create_key(storage, "bob")
    server = start_server(storage)
    yield server, alice, bob
    server.stop()


def batchgen(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in KEY_ENVS}
    return subprocess.run(
        [sys.executable, "-m", "batchgen.client.cli", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=60,
    )


def _tenants_seen(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == EXIT_OK, result.stderr
    return [entry["tenant"] for entry in json.loads(result.stdout)["tenants"]]


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("alice", {}, "alice"),
        (None, {"BATCHGEN_API_KEY": "alice"}, "alice"),
        (None, {"OPENAI_API_KEY": "bob"}, "bob"),
        (None, {"BATCHGEN_API_KEY": "alice", "OPENAI_API_KEY": "bob"}, "alice"),
        ("bob", {"BATCHGEN_API_KEY": "alice", "OPENAI_API_KEY": "alice"}, "bob"),
    ],
    ids=["flag", "batchgen-env", "openai-env", "batchgen-env-first", "flag-first"],
)
def test_the_key_comes_from_the_flag_then_the_environment(
    keyed: tuple[LiveServer, str, str], flag: str | None, env: dict[str, str], expected: str
) -> None:
    server, alice, bob = keyed
    keys = {"alice": alice, "bob": bob}
    args = ["pool", "--base-url", server.base_url] + (["--api-key", keys[flag]] if flag else [])
    result = batchgen(*args, env={name: keys[tenant] for name, tenant in env.items()})
    assert _tenants_seen(result) == [expected]  # the pool status shows the caller's own tenant


@pytest.mark.parametrize("key", [None, "bg-000000000000-" + "0" * 64], ids=["no-key", "wrong-key"])
def test_a_refused_key_exits_5_at_once_with_a_clear_message(
    keyed: tuple[LiveServer, str, str], key: str | None
) -> None:
    server = keyed[0]
    args = ["status", "batch_x", "--base-url", server.base_url, "--retries", "5"]
    result = batchgen(*args, *(["--api-key", key] if key else []))
    assert result.returncode == EXIT_UNAUTHORIZED
    assert "API key" in result.stderr
    assert "retry" not in result.stderr.lower()  # retries are logged; none happened
    if key is None:
        assert "--api-key" in result.stderr and "BATCHGEN_API_KEY" in result.stderr
    else:
        assert key not in result.stderr  # the key itself is never printed


def test_help_names_the_key_sources_and_exit_status() -> None:
    text = build_parser().format_help()
    assert "--api-key" in text and "BATCHGEN_API_KEY" in text and "OPENAI_API_KEY" in text
    assert "5 API key refused" in text
