"""Several ``batchgen-server`` processes on one PostgreSQL and one blob store: any serves any call.

The blob store is a shared folder (``file://``) or a real S3 server (SeaweedFS, ``s3://``); the
tests that upload, run and download run over both.

Real servers (``--metadata-url``, ``--blob-url``, the simulated backend) and the real ``openai``
SDK: a file uploaded to one replica and a batch created there are polled on another to
``completed`` and downloaded from a third, every request's line exactly once and the same bytes
from each, a ``Range`` of them answered 206, each line committed by exactly one replica (their
``/health``); every replica's ``/v1/pool/status`` and dashboard list all three replicas' work; each replica's ``/metrics`` has its own series, as docs/operations.md lists them; a replica killed with SIGKILL while it holds shards
of a 6,000-line batch, and a new one started, still end the batch with every line exactly once; a
key made with ``batchgen-server keys create --metadata-url`` is accepted by every replica and,
revoked, refused by every replica within 2 s. A server given only one of the two URLs, or a blob
URL it cannot use (credentials in an ``s3://`` URL, another scheme), refuses to start and says why.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx
import pytest
from openai import APIStatusError, OpenAI
from openai.types import Batch
from prometheus_client.parser import text_string_to_metric_families

from batchgen.core.work.segment_store import open_segment_store
from batchgen.core.work.shards import DEFAULT_LEASE_S
from tests.helpers import chat_line, jsonl
from tests.live import LiveServer
from tests.replica_fleet import Blobs, committed_once, running_replicas, start_replica
from tests.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.live


@pytest.fixture
def three(postgres_url: str, tmp_path: Path, blobs: Blobs) -> Iterator[list[LiveServer]]:
    with running_replicas(
        tmp_path, postgres_url, blobs, ("a", "b", "c"), "--simulated-latency-s", "0.002"
    ) as servers:
        yield servers


def _client(server: LiveServer, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=server.api_url, api_key=key, max_retries=0)


def _poll(client: OpenAI, batch_id: str, deadline: float) -> Batch | None:
    """The batch now, or None when the replica answered 503 (its database slow to hand it a
    connection, as on a loaded machine): docs/api.md's 503 is retried, until ``deadline``."""
    try:
        return client.batches.retrieve(batch_id)
    except APIStatusError as error:
        if error.status_code != 503 or time.monotonic() >= deadline:
            raise
        return None


def _wait_ended(client: OpenAI, batch_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = _poll(client, batch_id, deadline)
        if batch is not None and batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch.model_dump()
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def test_any_replica_answers_for_a_batch_made_on_another(
    three: list[LiveServer], tmp_path: Path, blobs: Blobs
) -> None:
    first, second, third = (_client(server) for server in three)
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(*(chat_line(f"r{i}", f"question {i}") for i in range(2500))))
    uploaded = first.files.create(file=path.open("rb"), purpose="batch")
    assert second.files.retrieve(uploaded.id).bytes == path.stat().st_size
    assert third.files.content(uploaded.id).content == path.read_bytes()  # from the store, not a's disk
    batch = first.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = _wait_ended(second, batch.id, 60)
    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == 2500
    output = third.files.content(ended["output_file_id"]).content
    assert output == first.files.content(ended["output_file_id"]).content
    lines = [json.loads(line) for line in output.splitlines()]
    assert Counter(line["custom_id"] for line in lines) == Counter(f"r{i}" for i in range(2500))
    assert {line["response"]["status_code"] for line in lines} == {200}
    usages = [line["response"]["body"]["usage"] for line in lines]  # the batch's usage sums its lines'
    assert ended["usage"]["input_tokens"] == sum(usage["prompt_tokens"] for usage in usages) > 0
    assert ended["usage"]["output_tokens"] == sum(usage["completion_tokens"] for usage in usages) > 0
    part = httpx.get(
        f"{three[1].api_url}/files/{ended['output_file_id']}/content", headers={"Range": "bytes=100-199"}
    )
    assert part.status_code == 206 and part.content == output[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(output)}"
    assert third.files.retrieve(ended["output_file_id"]).bytes == len(output)
    # each line committed once (a lease lost under load on a small machine may refuse a late
    # commit, which then counts nowhere: still once)
    reports = committed_once(dict(zip("abc", three, strict=True)), 2500)
    assert [report["id"] for report in reports.values()] == ["a", "b", "c"]
    # deleted on one replica: gone from all, and its segments from the store
    store = open_segment_store(blobs.url, blobs.environ)
    prefix = f"segments/{batch.id}/output/"
    before = list(store.keys())
    assert any(key.startswith(prefix) for key in before)
    first.files.delete(ended["output_file_id"])
    gone = httpx.get(f"{three[2].api_url}/files/{ended['output_file_id']}/content")
    assert gone.status_code == 404
    after = list(store.keys())
    assert not any(key.startswith(prefix) for key in after)


def test_every_replica_shows_every_replicas_work_in_its_pool_status_and_dashboard(
    three: list[LiveServer], tmp_path: Path
) -> None:
    client = _client(three[0])
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(*(chat_line(f"r{i}") for i in range(2000))))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert _wait_ended(client, batch.id, 60)["status"] == "completed"
    deadline = time.monotonic() + 10  # each replica saves its report every 2 s
    while True:
        listed = [httpx.get(f"{server.api_url}/pool/status").json()["replicas"] for server in three]
        committed = [sum(report["lines_committed"] for report in replicas) for replicas in listed]
        if committed == [2000, 2000, 2000]:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.5)
    for replicas in listed:
        assert [report["id"] for report in replicas] == ["a", "b", "c"]
        assert all(report["healthy"] and report["seen_s_ago"] < 10 for report in replicas)
    page = httpx.get(three[1].base_url + "/").text
    assert '<section id="replicas">' in page  # shown, not hidden, on a replica
    rows = re.findall(r'<tr data-replica-id="([a-c])">', page)
    assert rows == ["a", "b", "c"]


def test_a_replicas_metrics_are_its_own_and_documented(three: list[LiveServer]) -> None:
    families = {
        family.name: family
        for family in text_string_to_metric_families(httpx.get(f"{three[2].base_url}/metrics").text)
        if family.name.startswith("batchgen_replica_")
    }
    operations = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(batchgen_replica_[a-z_]+)` \|", operations, flags=re.MULTILINE))
    exported = {sample.name for family in families.values() for sample in family.samples}
    assert exported == documented and len(documented) == 4
    assert {sample.labels["replica"] for family in families.values() for sample in family.samples} == {"c"}


def test_a_replica_killed_holding_shards_loses_no_line_and_doubles_none(
    postgres_url: str, tmp_path: Path, blobs: Blobs
) -> None:
    flags = ("--simulated-latency-s", "0.02")
    # The default lease: with a 3 s one (a claim given up after a lease, a renewal after a third),
    # run alone with two busy loops beside it, both replicas gave claims up again and again (7 and
    # 8 times) and 500 lines were not reached in 120 s, in 2 runs of 3; with 10 s, 43 to 45 s.
    lease_s = DEFAULT_LEASE_S
    # the replica started after the kill joins the list, and is stopped with the others at the end
    with running_replicas(tmp_path, postgres_url, blobs, ("a", "b"), *flags, lease_s=lease_s) as servers:
        path = tmp_path / "input.jsonl"
        path.write_bytes(jsonl(*(chat_line(f"r{i}") for i in range(6000))))
        client = _client(servers[1])
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 120  # generous: a loaded machine stalls replicas for seconds
        while (polled := _poll(client, batch.id, deadline)) is None or (
            polled.request_counts.completed < 500  # type: ignore[union-attr]
        ):
            assert time.monotonic() < deadline, polled
            time.sleep(0.1)
        servers[0].process.send_signal(signal.SIGKILL)  # with shards half done, nothing released
        servers[0].process.wait()
        servers.append(start_replica(tmp_path, postgres_url, blobs, "a-again", *flags, lease_s=lease_s))
        ended = _wait_ended(_client(servers[2]), batch.id, 120)
        assert ended["status"] == "completed"
        output = client.files.content(ended["output_file_id"]).content
        ids = Counter(json.loads(line)["custom_id"] for line in output.splitlines())
        assert ids == Counter(f"r{i}" for i in range(6000))
        assert ended["request_counts"]["completed"] == 6000


@attrs.frozen
class WebhookedPair:
    """Two replicas sending webhooks to ``receiver``, their clients, and the file uploaded."""

    receiver: WebhookReceiver
    first: OpenAI
    second: OpenAI
    file_id: str

    def create(self, client: OpenAI) -> str:
        return client.batches.create(
            input_file_id=self.file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id


@contextmanager
def _two_sending_webhooks(postgres_url: str, tmp_path: Path, lines: int) -> Iterator[WebhookedPair]:
    """Two replicas on a shared folder with one webhook URL, and a file of ``lines`` requests
    uploaded to the first."""
    blobs = Blobs(f"file://{tmp_path / 'shared'}")
    with WebhookReceiver() as receiver:
        flags = ("--webhook-url", receiver.url, "--simulated-latency-s", "0.01")
        with running_replicas(tmp_path, postgres_url, blobs, ("a", "b"), *flags) as servers:
            first, second = (_client(server) for server in servers)
            path = tmp_path / "input.jsonl"
            path.write_bytes(jsonl(*(chat_line(f"r{i}") for i in range(lines))))
            uploaded = first.files.create(file=path.open("rb"), purpose="batch")
            yield WebhookedPair(receiver, first, second, uploaded.id)


def test_a_shared_batchs_ending_is_sent_once_as_a_webhook_whichever_replica_ends_it(
    postgres_url: str, tmp_path: Path
) -> None:
    """Two replicas with one webhook URL: a completed batch and a cancelled one each give one
    event (one ``webhook-id``, sent by whichever replica's sender got it), naming the batch."""
    with _two_sending_webhooks(postgres_url, tmp_path, 1500) as pair:
        done = pair.create(pair.first)
        assert _wait_ended(pair.second, done, 60)["status"] == "completed"
        stopped = pair.create(pair.second)
        pair.first.batches.cancel(stopped)
        assert _wait_ended(pair.second, stopped, 30)["status"] == "cancelled"
        pair.receiver.wait_for_deliveries(2)
        time.sleep(2.0)  # a second sender, or a second save of an ending, would show by now
        events = [
            (delivered.headers["webhook-id"], delivered.event()) for delivered in pair.receiver.received
        ]
    by_id = {event_id: event for event_id, event in events}
    assert len(by_id) == 2, events
    assert sorted((event["type"], event["data"]["id"]) for event in by_id.values()) == sorted(
        [("batch.completed", done), ("batch.cancelled", stopped)]
    )


def test_a_shared_batch_nobody_polls_still_ends_on_record_and_sends_its_webhook(
    postgres_url: str, tmp_path: Path
) -> None:
    """No call asks about the batch after its creation: its ending is saved all the same (its
    webhook arrives, and its input file is at once free to run again and to delete)."""
    with _two_sending_webhooks(postgres_url, tmp_path, 700) as pair:
        batch = pair.create(pair.first)
        event = pair.receiver.wait_for_deliveries(1, timeout_s=30)[0].event()
        assert (event["type"], event["data"]["id"]) == ("batch.completed", batch)
        again = pair.create(pair.second)  # the first batch is recorded ended: the file is free
        pair.second.batches.cancel(again)
        assert _wait_ended(pair.first, again, 30)["status"] == "cancelled"
        assert pair.second.files.delete(pair.file_id).deleted


def _keys(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchgen.server.cli", "keys", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_key_made_for_the_shared_database_works_on_every_replica_until_revoked(
    three: list[LiveServer], postgres_url: str
) -> None:
    made = _keys("create", "--tenant", "alpha", "--metadata-url", postgres_url)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    key_id = made.stdout.split("key ", 1)[1].split()[0]
    deadline = time.monotonic() + 2.0  # a replica that has the key refuses a call without one
    while not all(httpx.get(f"{s.api_url}/files").status_code == 401 for s in three):
        assert time.monotonic() < deadline, "a replica did not see the new key within 2 s"
        time.sleep(0.05)
    assert all(
        httpx.get(f"{s.api_url}/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for s in three
    )
    assert _keys("revoke", key_id, "--metadata-url", postgres_url).returncode == 0
    deadline = time.monotonic() + 2.0
    while any(
        httpx.get(f"{s.api_url}/files", headers={"Authorization": f"Bearer {key}"}).status_code != 401
        for s in three
    ):
        assert time.monotonic() < deadline, "a replica still took the revoked key after 2 s"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--metadata-url", "postgresql://nobody@127.0.0.1:1/db"), "go together"),
        (("--blob-url", "file:///tmp/shared"), "go together"),
        (
            ("--metadata-url", "postgresql://nobody@127.0.0.1:1/db", "--blob-url", "s3://me:pw@bucket/p"),
            "AWS_ACCESS_KEY_ID",
        ),
        (("--metadata-url", "postgresql://x@h/db", "--blob-url", "http://store/bucket"), "s3://BUCKET"),
        (("--metadata-url", "mysql://db", "--blob-url", "file:///tmp/shared"), "postgresql://"),
        (
            ("--metadata-url", "postgresql://x@h/db", "--blob-url", "file:///tmp/x", "--replica-id", "../up"),
            "replica id",
        ),
    ],
)
def test_a_server_given_shared_storage_it_cannot_use_refuses_to_start(
    tmp_path: Path, flags: tuple[str, ...], said: str
) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.server.cli",
            "--storage-path",
            str(tmp_path),
            "--backend",
            "simulated",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and said in run.stderr, run.stderr
