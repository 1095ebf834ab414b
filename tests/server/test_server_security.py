"""Starting a server safely: the open-address guard, HTTPS with ``--ssl-certfile/--ssl-keyfile``,
and usage figures that survive a restart. Each test starts real ``batchgen-server`` processes."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from tests.helpers import chat_line, jsonl, upload, wait_for_status
from tests.keys import authorized, create_key
from tests.live import LiveServer, free_port, start_server

pytestmark = pytest.mark.live


def _server_command(storage: Path, port: int, *flags: str) -> list[str]:
    """``batchgen-server`` on the simulated backend with ``storage`` on ``port``, and ``flags``."""
    command = [sys.executable, "-m", "batchgen.server.cli", "--backend", "simulated"]
    return [*command, "--storage-path", str(storage), "--port", str(port), *flags]


def _serve(storage: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run the server command expecting it to refuse to start (it must exit by itself)."""
    return subprocess.run(
        _server_command(storage, free_port(), *flags),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_an_open_address_with_no_key_refuses_to_start(tmp_path: Path, host: str) -> None:
    result = _serve(tmp_path / "storage", "--host", host)
    assert result.returncode != 0
    assert "batchgen-server keys create --tenant" in result.stderr
    assert "--allow-unauthenticated" in result.stderr


def test_an_open_address_starts_with_allow_unauthenticated(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory("--host", "0.0.0.0", "--allow-unauthenticated")
    assert httpx.get(f"{server.api_url}/files", timeout=30).status_code == 200  # no key needed


def test_an_open_address_starts_once_a_key_exists(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    _, key = create_key(storage, "team")
    server = start_server(storage, "--host", "0.0.0.0")
    try:
        assert httpx.get(f"{server.api_url}/files", timeout=30).status_code == 401
        with authorized(server.base_url, key) as client:
            assert client.get("/v1/files").status_code == 200
    finally:
        server.stop()


def test_loopback_with_no_key_serves_as_before(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory()
    assert httpx.get(f"{server.api_url}/files", timeout=30).status_code == 200
    assert (
        httpx.get(
            f"{server.api_url}/files", headers={"Authorization": "Bearer anything"}, timeout=30
        ).status_code
        == 200
    )


def test_https_with_a_certificate_serves_the_openai_sdk(tmp_path: Path) -> None:
    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    certificate.cert_chain_pems[0].write_to_path(str(cert_path))
    for blob in certificate.cert_chain_pems[1:]:
        blob.write_to_path(str(cert_path), append=True)
    certificate.private_key_pem.write_to_path(str(key_path))
    authority.cert_pem.write_to_path(str(ca_path))
    storage = tmp_path / "storage"
    storage.mkdir()
    _, key = create_key(storage, "secure")
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - handed to the child process
    process = subprocess.Popen(
        _server_command(storage, port, "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path)),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"https://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=str(ca_path))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{base}/health", verify=verify, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.1)
        transport = openai.DefaultHttpxClient(verify=verify)
        with openai.OpenAI(base_url=f"{base}/v1", api_key=key, http_client=transport, max_retries=0) as sdk:
            created = sdk.files.create(file=("in.jsonl", jsonl(chat_line("tls"))), purpose="batch")
            assert sdk.files.retrieve(created.id).id == created.id
        with pytest.raises(httpx.TransportError):  # the certificate is not trusted without the CA
            httpx.get(f"{base}/health", timeout=5)
        with pytest.raises(httpx.TransportError):  # and plain HTTP is not served on the port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_usage_figures_survive_a_restart(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    _, key = create_key(storage, "counted")
    server = start_server(storage)
    try:
        with authorized(server.base_url, key) as client:
            file_id = upload(client, jsonl(*[chat_line(f"u-{i}") for i in range(7)]))["id"]
            batch = client.post(
                "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
            )
            wait_for_status(client, batch.json()["id"], {"completed"})
            before = client.get("/v1/usage").json()["data"]
    finally:
        server.stop()
    assert before[0]["requests"] == 7 and before[0]["completion_tokens"] > 0
    again = start_server(storage)
    try:
        with authorized(again.base_url, key) as client:
            assert client.get("/v1/usage").json()["data"] == before
    finally:
        again.stop()
