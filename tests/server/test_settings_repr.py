"""Settings never show a secret in their repr: they get logged, printed in a debugger, put in errors.

A URL with credentials (``user:password@``, ``?token=…``) in ``--webhook-url``, ``--upstream`` or
a ``--model NAME=openai:upstream=…`` spec, an ``--upstream-api-key`` and a ``--webhook-secret``
are set through the real command line, with passwords Hypothesis builds; the repr of the
``ServerSettings``, the ``ServiceSettings`` it makes, each ``ModelEntry`` and the openai
backend's per-upstream state hold none of them, yet still name each URL's host and the options
that are not secret.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.backends.upstream_concurrency import UpstreamState
from batchgen.core.url_redaction import redacted_repr
from batchgen.server.cli import settings_from_args
from batchgen.server.model_specs import ModelEntry
from tests.examples import examples

MARK = "S3CRET"
_USER = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~", min_size=1, max_size=8)
# what an operator may type as a password, percent-encoded as a URL needs it
_PASSWORD = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+;=", max_size=10
)
_HOSTS = st.sampled_from(["127.0.0.1", "hooks.example.com", "up.example.org", "[::1]"])
_PORTS = st.sampled_from(["", ":8443", ":80"])
_PATHS = st.sampled_from(["", "/", "/v1", "/hooks/batchgen"])
_QUERIES = st.sampled_from(["", f"?token={MARK}", f"?a=1&api_key={MARK}x", f"?sig={MARK}&b=2"])


@st.composite
def _urls(draw: st.DrawFn) -> tuple[str, str]:
    """A URL with credentials holding ``MARK``, and its host."""
    host = draw(_HOSTS)
    user = draw(_USER)
    password = draw(_PASSWORD) + MARK + draw(_PASSWORD)
    userinfo = draw(st.sampled_from([f"{user}:{password}", f"{MARK}{user}", f"{user}:{password}"]))
    url = f"https://{userinfo}@{host}{draw(_PORTS)}{draw(_PATHS)}{draw(_QUERIES)}"
    return url, host


@settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(webhook=_urls(), upstream=_urls(), model_upstream=_urls(), key_tail=_USER)
def test_no_settings_repr_shows_a_secret(
    tmp_path: Path,
    webhook: tuple[str, str],
    upstream: tuple[str, str],
    model_upstream: tuple[str, str],
    key_tail: str,
) -> None:
    api_key = f"sk-{MARK}{key_tail}"
    argv = [
        "--storage-path",
        str(tmp_path),
        "--backend",
        "openai",
        "--upstream",
        upstream[0],
        "--upstream-api-key",
        api_key,
        "--webhook-url",
        webhook[0],
        "--webhook-secret",
        f"whsec_{MARK}{key_tail}",
        "--model",
        f"m=openai:upstream={model_upstream[0]},api_key={api_key}",
    ]
    server = settings_from_args(argv)
    assert server.webhook_url == (webhook[0],), "the URL itself is used unchanged"
    shown = {
        "ServerSettings": repr(server),
        "ServiceSettings": repr(server.service_settings()),
        "ModelEntry": repr(server.models[0]),
        "UpstreamState": repr(UpstreamState(upstream[0], None, None)),  # type: ignore[arg-type]
    }
    for name, text in shown.items():
        assert MARK not in text, (name, text)
    assert webhook[1] in shown["ServerSettings"] and webhook[1] in shown["ServiceSettings"]
    assert upstream[1] in shown["ServerSettings"] and model_upstream[1] in shown["ModelEntry"]
    assert "'max_concurrency': 64" in shown["ServerSettings"], "options that are no secret are shown"


def test_an_option_is_hidden_by_its_name_not_by_a_word_inside_it() -> None:
    options = {
        "api_key": "sk-1",
        "apiKey": "sk-2",
        "client_secret": "c",
        "access_token": "t",
        "unset_key": None,
        "token_latency_s": 0.5,
        "max_tokens": 10,
        "nested": {"password": "p", "url": f"http://u:{MARK}@h/"},
    }
    text = redacted_repr(options)
    assert all(secret not in text for secret in ("sk-1", "sk-2", "'c'", "'t'", "'p'", MARK)), text
    assert "'unset_key': None" in text and "'token_latency_s': 0.5" in text and "'max_tokens': 10" in text
    entry = ModelEntry("m", "openai", {"upstreams": (f"http://u:{MARK}@h/",)})
    assert MARK not in repr(entry) and "'http://***@h/'" in repr(entry)
