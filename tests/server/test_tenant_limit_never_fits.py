"""A batch that a tenant's own limits can never let in is a 400, not a 429.

A 429 tells a client to wait and retry (the ``openai`` SDK and the ``batchgen`` client do so by
themselves); a batch larger than the tenant's ``max_queued_requests``, or any batch of a tenant whose
``max_active_batches`` is 0, would be refused on every retry. It is answered 400 ``capacity_exceeded``
with no ``Retry-After``, and its message says why it can never fit and what fixes it (split the file,
or ``batchgen-server keys set-limits``). A batch that fits the limits keeps the 429 with
``Retry-After`` while the tenant's other work drains, or is accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.core.tenancy import TenantLimits
from batchgen.server.api_keys import KeyStore
from tests.conftest import in_process_app
from tests.examples import examples
from tests.helpers import chat_line, jsonl, upload

ENDPOINT = "/v1/chat/completions"


class Limited:
    def __init__(self, client: TestClient[Litestar], store: KeyStore, key: str) -> None:
        self.client, self.store, self.key = client, store, key

    def file_of(self, size: int) -> str:
        """A new file of ``size`` requests (a file of its own for each batch: a batch still running
        on a file is refused a second batch on it, whatever the limits say)."""
        lines = [chat_line(f"r-{size}-{i}") for i in range(size)]
        file_id: str = upload(self.client, jsonl(*lines), headers=self.headers)["id"]
        return file_id

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    storage: Path = tmp_path_factory.mktemp("limits") / "storage"
    storage.mkdir(parents=True)
    store = KeyStore(storage / "metadata.sqlite3")
    _, key = store.create_key("carol")
    try:
        with TestClient(in_process_app(storage), timeout=30) as client:
            yield Limited(client, store, key)
    finally:
        store.close()


def _assert_never_fits(response: httpx.Response, requests: int, limits: TenantLimits) -> None:
    assert response.status_code == 400, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "capacity_exceeded" and error["type"] == "invalid_request_error", error
    assert error["param"] == "input_file_id"
    message = error["message"]
    assert "Retry later" not in message and "never" in message and "do not retry" in message
    assert "carol" in message and "batchgen-server keys set-limits --tenant carol" in message
    if limits.max_queued_requests is not None and requests > limits.max_queued_requests:
        assert f"({requests} requests)" in message
        assert f"{limits.max_queued_requests} queued requests" in message and "Split the file" in message
    else:
        assert "max_active_batches is 0" in message


@settings(max_examples=examples(40), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.integers(1, 9),
    max_queued=st.none() | st.integers(0, 9),
    max_active=st.none() | st.integers(0, 3),
)
def test_a_batch_the_tenants_limits_can_never_let_in_is_400_and_one_that_can_is_never_400(
    limited: Limited, requests: int, max_queued: int | None, max_active: int | None
) -> None:
    limits = TenantLimits(max_queued_requests=max_queued, max_active_batches=max_active)
    limited.store.set_limits("carol", limits)  # the running server reads it on the next call
    response = limited.client.post(
        "/v1/batches",
        json={"input_file_id": limited.file_of(requests), "endpoint": ENDPOINT},
        headers=limited.headers,
    )
    never = (max_queued is not None and requests > max_queued) or max_active == 0
    if never:
        _assert_never_fits(response, requests, limits)
    else:  # accepted, or a 429 that a wait can end (the tenant's earlier batches still running)
        assert response.status_code in (200, 429), response.text
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "capacity_exceeded"
    limited.store.set_limits("carol", TenantLimits())


def test_the_openai_sdk_does_not_retry_a_batch_that_can_never_fit(limited: Limited) -> None:
    """The SDK retries a 429 by itself; the 400 reaches the caller at the first answer."""
    limited.store.set_limits("carol", TenantLimits(max_queued_requests=2))
    file_id = limited.file_of(3)
    sent: list[httpx.Request] = []
    limited.client.event_hooks["request"].append(sent.append)
    try:
        sdk = openai.OpenAI(
            api_key=limited.key,
            base_url="http://testserver/v1",
            http_client=cast(Any, limited.client),  # a TestClient is an httpx.Client
            max_retries=3,
        )
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
    finally:
        limited.client.event_hooks["request"].remove(sent.append)
        limited.store.set_limits("carol", TenantLimits())
    assert len([r for r in sent if r.url.path == "/v1/batches"]) == 1
    assert raised.value.code == "capacity_exceeded"
    assert "never fit" in raised.value.message


def test_a_batch_the_limits_let_in_once_earlier_batches_drain_is_429_with_retry_after(tmp_path: Path) -> None:
    """The tenant's limits fit the batch, its earlier batch still runs: a 429 a wait can end."""
    storage = tmp_path / "storage"
    storage.mkdir()
    store = KeyStore(storage / "metadata.sqlite3")
    _, key = store.create_key("carol", limits=TenantLimits(max_queued_requests=3, max_active_batches=1))
    store.close()
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(in_process_app(storage, "--simulated-latency-s", "30"), timeout=30) as client:
        first = upload(client, jsonl(chat_line("a"), chat_line("b")), headers=headers)["id"]
        running = client.post(
            "/v1/batches", json={"input_file_id": first, "endpoint": ENDPOINT}, headers=headers
        )
        assert running.status_code == 200, running.text
        second = upload(client, jsonl(chat_line("c")), headers=headers)["id"]
        response = client.post(
            "/v1/batches", json={"input_file_id": second, "endpoint": ENDPOINT}, headers=headers
        )
        assert response.status_code == 429, response.text
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "capacity_exceeded" and "max_active_batches" in error["message"]
        assert "never" not in error["message"]
        client.post(f"/v1/batches/{running.json()['id']}/cancel", headers=headers)
