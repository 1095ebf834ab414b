"""Credentials in URLs: ``redact_url`` keeps a URL recognisable and never lets its secrets through.

The secrets are the userinfo (``user:password@``; a password with characters that should have
been percent-encoded included) and the values of query parameters named like a secret (token,
key, secret, password, signature, auth, ...). Hypothesis builds the URLs.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import quote

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import CHAT_COMPLETIONS, GenerationRequest, SamplingParameters
from batchgen.core.url_redaction import redact_url, redact_urls_in
from batchgen.core.webhook_outbox import OutboxMessage, WebhookTargets, check_webhook_url

MARK = "S3CRET"
_SAFE = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~", max_size=12)
# a password as an operator may type it: any printable ASCII, unencoded ("/", "?", "#", "@" too)
_RAW = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12)
_HOSTS = st.sampled_from(["127.0.0.1", "example.com", "hooks.example.org", "[::1]"])
_PORTS = st.sampled_from(["", ":80", ":8443"])
_PATHS = st.sampled_from(["", "/", "/hooks/batchgen", "/a/b.json"])
_SECRET_NAMES = st.sampled_from(
    [
        "token",
        "access_token",
        "api_key",
        "apiKey",
        "X-Api-Key",
        "secret",
        "client_secret",
        "password",
        "sig",
        "signature",
        "X-Amz-Signature",
        "auth",
        "session_id",
    ]
)
_PLAIN_NAMES = st.sampled_from(["page", "tenant", "format", "v"])


def _secret(tail: str) -> str:
    return MARK + tail


@given(
    user=_SAFE,
    password=_RAW,
    encode=st.booleans(),
    host=_HOSTS,
    port=_PORTS,
    path=_PATHS,
)
def test_userinfo_never_survives(
    user: str, password: str, encode: bool, host: str, port: str, path: str
) -> None:
    secret = _secret(password)
    userinfo = f"{user}:{quote(secret, safe='') if encode else secret}"
    url = f"https://{userinfo}@{host}{port}{path}"
    redacted = redact_url(url)
    assert MARK not in redacted, (url, redacted)
    assert quote(secret, safe="") not in redacted
    assert redacted.startswith("https://***@")
    assert redact_urls_in(f"could not reach {url}: refused", [url]).count(MARK) == 0


@given(user=_SAFE.map(_secret), host=_HOSTS, path=_PATHS)
def test_a_user_alone_is_redacted_too(user: str, host: str, path: str) -> None:
    """``https://TOKEN@host/``: a bare user name is often the credential itself."""
    assert MARK not in redact_url(f"https://{user}@{host}{path}")


@given(
    host=_HOSTS,
    path=_PATHS,
    secrets=st.lists(st.tuples(_SECRET_NAMES, _SAFE.map(_secret)), min_size=1, max_size=3),
    plain=st.lists(st.tuples(_PLAIN_NAMES, _SAFE), max_size=3),
    order=st.randoms(use_true_random=False),
)
def test_secret_query_values_never_survive_and_the_rest_stays(
    host: str, path: str, secrets: list[tuple[str, str]], plain: list[tuple[str, str]], order: object
) -> None:
    pairs = [*secrets, *plain]
    order.shuffle(pairs)  # type: ignore[attr-defined]
    url = f"http://{host}{path or '/'}?" + "&".join(f"{name}={value}" for name, value in pairs)
    redacted = redact_url(url)
    assert MARK not in redacted, (url, redacted)
    for name, value in plain:
        assert f"{name}={value}" in redacted
    assert host in redacted


@pytest.mark.parametrize(
    "url",
    ["https://example.com/hooks?page=2", "http://127.0.0.1:8080/hooks/batchgen", "http://[::1]:9/x#frag"],
)
def test_a_url_without_credentials_is_unchanged(url: str) -> None:
    assert redact_url(url) == url


@given(password=_RAW.map(_secret))
def test_refusals_and_reprs_show_webhook_urls_redacted(password: str) -> None:
    bad = f"ftp://user:{password}@example.com/hook"
    with pytest.raises(InvalidRequest) as refused:
        check_webhook_url(bad, "--webhook-url")
    assert MARK not in refused.value.message
    good = f"http://user:{quote(password, safe='')}@example.com/hook?token={quote(password, safe='')}"
    assert MARK not in repr(WebhookTargets((good,)))
    assert MARK not in repr(OutboxMessage("evt_1", good, b"{}", 1))


def test_an_upstreams_credentials_stay_out_of_its_errors_health_and_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same class on the openai backend: an upstream URL with userinfo and an api_key, down
    (nothing listens on its port), is named redacted in the refusal of a bad flag, in the request's
    failure, in health and in every log record (httpx's request log included)."""
    password, token = f"pw-{MARK}-1", f"key-{MARK}-2"
    url = f"http://user:{password}@127.0.0.1:{_closed_port()}/v1?api_key={token}"

    async def scenario() -> tuple[str, str]:
        backend = OpenAIUpstreamBackend(upstreams=[url], max_attempts=1, probe_interval_s=60)
        await backend.start()
        try:
            messages = ({"role": "user", "content": "hi"},)
            request = GenerationRequest(
                "r1", CHAT_COMPLETIONS, SamplingParameters(max_tokens=4), messages=messages
            )
            with pytest.raises(Exception) as failed:
                await backend.generate(request)
            return str(failed.value), str(backend.health())
        finally:
            await backend.stop()

    with caplog.at_level(logging.DEBUG):
        failure, health = anyio.run(scenario)
        with pytest.raises(ValueError) as bad:
            OpenAIUpstreamBackend(upstreams=[url.replace("http://", "ftp://")])
    logged = [record.getMessage() for record in caplog.records]
    assert "127.0.0.1" in failure and "127.0.0.1" in health
    for shown in (failure, health, str(bad.value), *logged):
        assert MARK not in shown, shown


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
