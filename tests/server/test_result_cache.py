"""The result cache through the real server: a second run of the same deterministic requests is
answered from the cache with the first run's response bodies byte for byte (but for
``cached_tokens``, then every prompt token of the answer); what it saved shows
in the batch's usage, ``/metrics``, the openai SDK's batch object and both clients; non-
deterministic requests, other models, endpoints and tenants never share an entry; the cache keeps
its bound, survives a restart, and a kill -9 during a cached run keeps every request exactly once.

In-process servers (``api_factory``, real SQLite and files) except where a process is needed:
the kill -9, and the openai SDK, both clients and the ``batchgen`` command against a live server.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.client import AsyncBatchGenClient, BatchGenHttpClient, CacheSavings, cache_savings
from batchgen.server.api_keys import KeyStore
from batchgen.server.cli import settings_from_args
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    TERMINAL,
    as_replayed,
    chat_line,
    completion_line,
    create_batch,
    jsonl,
    read_jsonl,
    upload,
    wait_for_status,
    write_jsonl,
)
from tests.live import LiveServer

CACHE_FILE = "result_cache.sqlite3"


class _Response(msgspec.Struct):
    body: msgspec.Raw


class _Line(msgspec.Struct):
    id: str
    custom_id: str
    response: _Response | None
    cached: bool = False


_decode_line = msgspec.json.Decoder(_Line).decode


def _raw_lines(content: bytes) -> dict[str, _Line]:
    """The output lines by custom_id, their response bodies as the raw bytes the file holds."""
    lines = [_decode_line(raw) for raw in content.splitlines()]
    return {line.custom_id: line for line in lines}


def _body(line: _Line) -> bytes:
    assert line.response is not None
    return bytes(line.response.body)


def _run(
    client: httpx.Client,
    content: bytes,
    endpoint: str = CHAT,
    *,
    headers: dict[str, str] | None = None,
    fields: dict[str, object] | None = None,
) -> dict[str, Any]:
    """Run ``content`` as one batch (``fields``: more of the create body) to its end; the batch,
    with its output lines under ``"lines"``."""
    file_id = upload(client, content, headers=headers)["id"]
    body = {"input_file_id": file_id, "endpoint": endpoint, **(fields or {})}
    response = client.post("/v1/batches", json=body, headers=headers)
    assert response.status_code == 200, response.text
    batch_id = response.json()["id"]
    deadline = time.monotonic() + 120
    while True:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}", headers=headers).json()
        if batch["status"] in TERMINAL or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert batch["status"] == "completed", batch
    output = client.get(f"/v1/files/{batch['output_file_id']}/content", headers=headers)
    assert output.status_code == 200, output.text
    batch["lines"] = _raw_lines(output.content)
    return batch


def _metric(client: httpx.Client, name: str, headers: dict[str, str] | None = None) -> float:
    for line in client.get("/metrics", headers=headers).text.splitlines():
        if line.split(" ")[0] == name:  # name, or name{labels}
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def _complete_prefix(path: Path) -> bytes:
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1]


def _written(client: httpx.Client, headers: dict[str, str] | None = None) -> None:
    """Wait until the cache's new entries are in its file (it writes them every 0.2 s)."""
    deadline = time.monotonic() + 10
    while _metric(client, "batchgen_result_cache_waiting_entries", headers) > 0:
        assert time.monotonic() < deadline, "the cache's entries were never written"
        time.sleep(0.02)


def _entries(storage: Path) -> tuple[int, int]:
    """(entries, bytes) the cache file holds."""
    with sqlite3.connect(storage / CACHE_FILE) as db:
        count, size = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
    return int(count), int(size)


def _reordered(line: dict[str, Any], custom_id: str) -> bytes:
    """``line`` with another custom_id, its body's keys in reverse order and odd spacing."""
    body = dict(reversed(list(line["body"].items())))
    text = json.dumps(body, indent=3, separators=(" ,  ", " :  "))
    return (
        f'{{"url": "{line["url"]}",  "body": {text.replace(chr(10), " ")}, "method": "POST", '
        f'"custom_id": {json.dumps(custom_id)}}}\n'
    ).encode()


# --- a second run of 10,000 greedy lines ---------------------------------------------------------


def test_a_second_run_of_10000_greedy_lines_comes_from_the_cache_byte_for_byte(
    api_factory: Callable[..., TestClient[Litestar]],
) -> None:
    client = api_factory("--result-cache-tenant", "default", "--max-pool-size", "512")
    total = 10_000
    lines = [
        chat_line(f"first-{i}", f"question number {i}", temperature=0, max_tokens=32) for i in range(total)
    ]
    first = _run(client, jsonl(*lines))
    prompt_before = _metric(client, "batchgen_prompt_tokens_total")
    # the same requests under new custom_ids, keys reordered and respaced, in another order
    order = list(range(total))
    random.Random(7).shuffle(order)
    second = _run(client, b"".join(_reordered(lines[i], f"second-{i}") for i in order))

    assert first["usage"]["cached_requests"] == 0 and not any(line.cached for line in first["lines"].values())
    assert second["request_counts"] == {"total": total, "completed": total, "failed": 0}
    assert second["usage"]["cached_requests"] == total
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == first["usage"]["input_tokens"]
    assert second["usage"]["saved_tokens"] == first["usage"]["total_tokens"]
    assert second["usage"]["output_tokens"] == first["usage"]["output_tokens"]
    for i in range(total):
        replayed, original = second["lines"][f"second-{i}"], first["lines"][f"first-{i}"]
        assert replayed.cached, i
        assert _body(replayed) == as_replayed(_body(original)), i  # byte for byte, but cached_tokens
        assert replayed.id != original.id  # the line itself is the new batch's
    assert len({line.id for line in second["lines"].values()}) == total
    # nothing was computed again: the engine saw no prompt token of the second run
    assert _metric(client, "batchgen_prompt_tokens_total") == prompt_before
    assert _metric(client, 'batchgen_result_cache_lookups_total{result="hit"}') == total
    assert _metric(client, 'batchgen_result_cache_lookups_total{result="miss"}') == total
    assert (
        _metric(client, 'batchgen_result_cache_saved_tokens_total{kind="prompt"}')
        == first["usage"]["input_tokens"]
    )
    _written(client)
    assert _metric(client, "batchgen_result_cache_entries") == total


# --- what is cached, and under which key (Hypothesis over request bodies) -------------------------

_words = st.text(alphabet="abcdefghij klm", min_size=1, max_size=24)
_sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0, 0.0, 0.5, 1.0, 1.7]),
        "seed": st.integers(0, 2**31),
        "n": st.just(1),  # more choices: the simulated backend refuses them (the key tests cover n > 1)
        "top_p": st.sampled_from([0.5, 1.0]),
        "max_tokens": st.integers(1, 40),
        "stop": st.lists(_words, max_size=2),
    },
)


def _deterministic(body: dict[str, Any], batch_temperature: float | None) -> bool:
    """What the docs promise: one choice, and greedy (the line's or the batch's temperature 0, or
    no temperature at all: the server's default is greedy) or an explicit seed (the simulated
    backend honours seeds)."""
    if body.get("n", 1) != 1:
        return False
    temperature = body.get("temperature", batch_temperature if batch_temperature is not None else 0)
    return temperature == 0 or "seed" in body


@pytest.fixture(scope="module")
def cached_api(tmp_path_factory: pytest.TempPathFactory) -> Any:
    storage = tmp_path_factory.mktemp("cache") / "storage"
    with TestClient(in_process_app(storage, "--result-cache-tenant", "*"), timeout=30) as client:
        store = KeyStore(storage / "metadata.sqlite3")
        keys = {
            tenant: {"Authorization": f"Bearer {store.create_key(tenant)[1]}"} for tenant in ("alice", "bob")
        }
        store.close()
        yield client, keys, storage


@settings(max_examples=examples(25), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_words, sampling=_sampling, batch_temperature=st.sampled_from([None, 0.0, 0.8]))
def test_only_deterministic_requests_are_cached_and_spelling_does_not_matter(
    cached_api: Any, prompt: str, sampling: dict[str, Any], batch_temperature: float | None
) -> None:
    client, keys, _ = cached_api
    alice = keys["alice"]
    line = chat_line("x", prompt, **sampling)
    extra: dict[str, object] = {} if batch_temperature is None else {"temperature": batch_temperature}
    first = _run(client, jsonl(line), headers=alice, fields=extra)
    again = _run(client, _reordered(line, "y"), headers=alice, fields=extra)
    [replayed] = again["lines"].values()
    expected = _deterministic(line["body"], batch_temperature)
    assert replayed.cached is expected, (line, batch_temperature)
    assert again["usage"]["cached_requests"] == int(expected)
    if expected:
        assert _body(replayed) == as_replayed(_body(first["lines"]["x"]))
    else:
        assert again["usage"]["saved_tokens"] == 0


@settings(max_examples=examples(10), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_words, seed=st.none() | st.integers(0, 1000))
def test_tenants_never_share_an_entry(cached_api: Any, prompt: str, seed: int | None) -> None:
    client, keys, _ = cached_api
    nonce = f"{time.monotonic_ns()} {prompt}"  # a request neither tenant ran before
    line = (
        chat_line("x", nonce, temperature=0)
        if seed is None
        else chat_line("x", nonce, temperature=1, seed=seed)
    )
    alice = _run(client, jsonl(line), headers=keys["alice"])
    bob = _run(client, jsonl(line), headers=keys["bob"])
    assert not alice["lines"]["x"].cached and not bob["lines"]["x"].cached
    assert bob["usage"]["cached_requests"] == 0
    # each tenant's second run is answered by its own entry
    for tenant in ("alice", "bob"):
        again = _run(client, jsonl(line), headers=keys[tenant])
        assert again["lines"]["x"].cached and again["usage"]["cached_requests"] == 1


def test_a_tenant_not_named_is_never_cached_and_stores_nothing(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path
) -> None:
    client = api_factory("--result-cache-tenant", "alice")
    storage = tmp_path / "storage"
    store = KeyStore(storage / "metadata.sqlite3")
    alice = {"Authorization": f"Bearer {store.create_key('alice')[1]}"}
    bob = {"Authorization": f"Bearer {store.create_key('bob')[1]}"}
    store.close()
    lines = jsonl(*[chat_line(f"r{i}", f"same question {i}", temperature=0) for i in range(20)])
    for _ in range(2):
        batch = _run(client, lines, headers=bob)
        assert batch["usage"]["cached_requests"] == 0
        assert not any(line.cached for line in batch["lines"].values())
    _written(client, alice)
    assert _entries(storage) == (0, 0)
    _run(client, lines, headers=alice)
    _written(client, alice)
    assert _entries(storage)[0] == 20
    assert _run(client, lines, headers=alice)["usage"]["cached_requests"] == 20
    assert _run(client, lines, headers=bob)["usage"]["cached_requests"] == 0


def test_without_the_flag_nothing_changes_and_no_cache_file_is_made(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path
) -> None:
    client = api_factory()
    lines = jsonl(*[chat_line(f"r{i}", "the same question", temperature=0) for i in range(5)])
    for _ in range(2):
        batch = _run(client, lines)
        assert batch["usage"]["cached_requests"] == 0 and batch["usage"]["saved_tokens"] == 0
        assert not any(line.cached for line in batch["lines"].values())
    assert not (tmp_path / "storage" / CACHE_FILE).exists()
    assert _metric(client, "batchgen_result_cache_entries") == 0


def test_another_model_under_the_same_name_or_another_endpoint_never_shares(
    tmp_path: Path,
) -> None:
    storage = tmp_path / "storage"
    chat = jsonl(*[chat_line(f"c{i}", f"prompt {i}", temperature=0) for i in range(5)])
    completion = jsonl(
        *[completion_line(f"p{i}", f"prompt {i}", temperature=0, model="default") for i in range(5)]
    )
    flags = ("--result-cache-tenant", "default")
    with TestClient(in_process_app(storage, "--model", "first=simulated", *flags), timeout=30) as client:
        assert _run(client, chat)["usage"]["cached_requests"] == 0
        assert _run(client, completion, COMPLETIONS)["usage"]["cached_requests"] == 0
        assert _run(client, chat)["usage"]["cached_requests"] == 5
        assert _run(client, completion, COMPLETIONS)["usage"]["cached_requests"] == 5
    # "default" now names another model: the same lines must run on it
    with TestClient(
        in_process_app(storage, "--model", "second=simulated:seed=3", *flags), timeout=30
    ) as client:
        assert _run(client, chat)["usage"]["cached_requests"] == 0
        assert _run(client, chat)["usage"]["cached_requests"] == 5


def test_errors_are_never_cached(api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path) -> None:
    client = api_factory("--result-cache-tenant", "default", "--simulated-failure-rate", "1")
    lines = jsonl(*[chat_line(f"r{i}", f"failing prompt {i}", temperature=0) for i in range(5)])
    for _ in range(2):
        file_id = upload(client, lines)["id"]
        batch = wait_for_status(client, create_batch(client, file_id)["id"], TERMINAL)
        assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
        assert batch["usage"]["cached_requests"] == 0
    _written(client)
    assert _entries(tmp_path / "storage") == (0, 0)
    assert _metric(client, 'batchgen_result_cache_lookups_total{result="hit"}') == 0


# --- bounds, eviction, restarts -----------------------------------------------------------------


@pytest.mark.parametrize("bound", [("--result-cache-max-entries", "7"), ("--result-cache-max-bytes", "4000")])
def test_eviction_keeps_the_store_within_its_bound(
    api_factory: Callable[..., TestClient[Litestar]], tmp_path: Path, bound: tuple[str, str]
) -> None:
    client = api_factory("--result-cache-tenant", "default", *bound)
    flag, limit = bound[0], int(bound[1])
    for round_ in range(4):
        lines = [chat_line(f"r{i}", f"round {round_} prompt {i}", temperature=0) for i in range(10)]
        _run(client, jsonl(*lines))
        _written(client)
        entries, size = _entries(tmp_path / "storage")
        assert entries >= 1
        assert (entries if flag.endswith("entries") else size) <= limit
        assert _metric(client, "batchgen_result_cache_entries") == entries
        assert _metric(client, "batchgen_result_cache_bytes") == size
    assert _metric(client, "batchgen_result_cache_evictions_total") > 0
    # the most recent answers are the ones kept
    assert _run(client, jsonl(lines[-1]))["usage"]["cached_requests"] == 1
    assert (
        _run(client, jsonl(chat_line("old", "round 0 prompt 0", temperature=0)))["usage"]["cached_requests"]
        == 0
    )


def test_a_restart_keeps_the_cache(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    lines = jsonl(*[chat_line(f"r{i}", f"kept across restarts {i}", temperature=0) for i in range(50)])
    flags = ("--result-cache-tenant", "default")
    with TestClient(in_process_app(storage, *flags), timeout=30) as client:
        first = _run(client, lines)
    with TestClient(in_process_app(storage, *flags), timeout=30) as client:
        assert _metric(client, "batchgen_result_cache_entries") == 50
        second = _run(client, lines)
    assert second["usage"]["cached_requests"] == 50
    assert all(
        _body(second["lines"][key]) == as_replayed(_body(first["lines"][key])) for key in first["lines"]
    )
    # a restart with a lower bound trims the file to it at once
    with TestClient(in_process_app(storage, *flags, "--result-cache-max-entries", "10"), timeout=30):
        assert _entries(storage)[0] == 10


# --- the savings in the openai SDK, both clients and the CLI; kill -9 ----------------------------


def test_the_savings_show_in_the_openai_sdk_both_clients_and_batchgen_status(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    server = server_factory("--result-cache-tenant", "default")
    input_path = write_jsonl(
        tmp_path / "in.jsonl", [chat_line(f"r{i}", f"sdk question {i}", temperature=0) for i in range(6)]
    )
    with BatchGenHttpClient(server.base_url) as ours:
        first = ours.submit_batch(input_path, tmp_path / "first.jsonl", progress=False)
        second = ours.submit_batch(input_path, tmp_path / "second.jsonl", progress=False)
    assert cache_savings(first) == CacheSavings(0, 0, 0)
    assert cache_savings(second) == CacheSavings(
        6, first["usage"]["input_tokens"], first["usage"]["total_tokens"]
    )
    firsts = _raw_lines((tmp_path / "first.jsonl").read_bytes())
    seconds = _raw_lines((tmp_path / "second.jsonl").read_bytes())
    assert {key: _body(line) for key, line in seconds.items()} == {
        key: as_replayed(_body(line)) for key, line in firsts.items()
    }

    async def through_the_async_client() -> dict[str, Any]:
        async with AsyncBatchGenClient(server.base_url) as client:
            return await client.submit_batch(input_path, tmp_path / "third.jsonl", progress=False)

    third = anyio.run(through_the_async_client)
    assert cache_savings(third) == cache_savings(second)

    sdk = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    parsed = sdk.batches.retrieve(second["id"])  # the SDK parses the batch object unchanged
    assert parsed.usage is not None
    assert parsed.usage.input_tokens_details.cached_tokens == first["usage"]["input_tokens"]
    assert parsed.usage.model_extra == {
        "cached_requests": 6,
        "saved_tokens": first["usage"]["total_tokens"],
        "prefix_cached_tokens": 0,  # the simulated engine has no prefix cache
    }

    status = subprocess.run(
        [sys.executable, "-m", "batchgen.client.cli", "--base-url", server.base_url, "status", second["id"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["usage"]["cached_requests"] == 6
    assert "6 requests answered from the result cache" in status.stderr


def test_kill_9_during_a_cached_run_keeps_every_request_exactly_once(
    server_factory: Callable[..., LiveServer], tmp_path: Path
) -> None:
    flags: tuple[str, ...] = ("--result-cache-tenant", "default", "--simulated-latency-s", "0.05")
    flags += ("--max-pool-size", "32")
    flags += ("--fsync-interval-ms", "50")
    known = [chat_line(f"k{i}", f"known prompt {i}", temperature=0) for i in range(2000)]
    server = server_factory(*flags, storage="durable")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        first = _run(client, jsonl(*known))
        # half the lines are answered from the cache, half run, side by side
        mixed = [
            line
            for i in range(2000)
            for line in (known[i], chat_line(f"n{i}", f"new prompt {i}", temperature=0))
        ]
        mixed = [{**line, "custom_id": f"m-{line['custom_id']}"} for line in mixed]
        batch_id = create_batch(client, upload(client, jsonl(*mixed))["id"])["id"]
    output = server.storage_path / "incremental" / f"{batch_id}.jsonl"
    rng = random.Random(99)
    for _ in range(2):
        time.sleep(rng.uniform(0.3, 0.8))
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        written = list(_raw_lines(_complete_prefix(output)).values())
        assert len(written) < len(mixed), "the batch finished before the kill; the test proves nothing"
        assert any(line.cached for line in written), "killed before the cache answered anything"
        server = server_factory(*flags, storage="durable")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        done = wait_for_status(client, batch_id, TERMINAL, timeout_s=120)
    assert done["status"] == "completed", done
    content = output.read_bytes()
    ids = [line["custom_id"] for line in read_jsonl(output)]
    assert len(ids) == len(set(ids)) == len(mixed), "every request ends with exactly one line"
    lines = _raw_lines(content)
    cached = [key for key, line in lines.items() if line.cached]
    assert sorted(cached) == sorted(f"m-k{i}" for i in range(2000)), (
        "every known line, and only those, replayed"
    )
    for i in range(2000):
        assert _body(lines[f"m-k{i}"]) == as_replayed(_body(first["lines"][f"k{i}"]))
    assert done["usage"]["cached_requests"] == 2000  # rebuilt from the lines after each kill
    assert done["request_counts"] == {"total": 4000, "completed": 4000, "failed": 0}


def test_the_dashboard_shows_what_the_cache_saved_a_batch(
    api_factory: Callable[..., TestClient[Litestar]],
) -> None:
    client = api_factory("--result-cache-tenant", "default")
    lines = jsonl(*[chat_line(f"r{i}", f"dashboard question {i}", temperature=0) for i in range(4)])
    plain = _run(client, lines)
    cached = _run(client, lines)
    page = client.get("/").text
    assert f'data-batch-id="{cached["id"]}"' in page
    assert 'data-cached="4"' in page and "4/4 (4 from cache)" in page
    row = page[page.index(f'data-batch-id="{plain["id"]}"') :]
    assert 'data-cached="0"' in row.split("</tr>", 1)[0]
    script = client.get("/ui/dashboard.js").text
    assert "cached_requests" in script and "from cache" in script


@pytest.mark.parametrize(
    "flags",
    [
        ("--result-cache-tenant", ""),
        ("--result-cache-tenant", "no spaces"),
        ("--result-cache-max-bytes", "0"),
        ("--result-cache-max-entries", "-1"),
        ("--result-cache-max-entries", "many"),
    ],
)
def test_bad_cache_flags_are_usage_errors(flags: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        settings_from_args(["--backend", "simulated", *flags])
    assert stopped.value.code == 2
    assert flags[0] in capsys.readouterr().err
