"""Redacting credentials from URLs before they are logged or shown.

A URL an operator or a client configures (a webhook, an upstream) may carry credentials: the
userinfo (``https://user:password@host/``) and query parameters such as ``?token=…`` or
``&api_key=…``. ``redact_url`` returns the URL with those replaced by ``***``, keeping what tells
one URL from another (scheme, host, port, path, the other parameters); ``redact_urls_in`` does
the same for each of some URLs inside a text (an error message that quotes one). Every log line,
metric label, error message and page that names such a URL uses them; the URL itself is used
unchanged to connect. ``redacted_repr`` is the repr of a settings field that may hold one (or an
API key: a mapping's value under a secret name is hidden whole). ``redact_logger`` makes a library's logger (httpx logs each request's full
URL at INFO) redact what it logs.

A query parameter is secret when its name (case-insensitive, ``-`` and ``_`` ignored) contains
one of ``SECRET_PARAMETER_WORDS``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote_plus, urlsplit, urlunsplit

REDACTED = "***"
#: Words that make a query parameter secret when its name contains one.
SECRET_PARAMETER_WORDS = (
    "token",
    "key",
    "secret",
    "pass",
    "pwd",
    "auth",
    "sig",
    "credential",
    "session",
    "cookie",
    "jwt",
    "bearer",
)
#: How the name of an option whose value is a secret ends (``redacted_repr``).
SECRET_OPTION_ENDINGS = (
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "pwd",
    "credential",
    "credentials",
    "cookie",
    "auth",
    "authorization",
    "jwt",
    "bearer",
)
# userinfo in a text that may hold a URL: "//" up to the last "@" of the same word (greedy: a
# password may hold any character; a word with an "@" in its path is redacted more than needed)
_USERINFO = re.compile(r"(//)[^\s'\"<>]*@")
_SECRET_IN_QUERY = re.compile(r"([?&;])([^=&;#\s]*)=([^&;#\s]*)")


def _is_secret(name: str) -> bool:
    folded = unquote_plus(name).lower().replace("-", "").replace("_", "")
    return any(word in folded for word in SECRET_PARAMETER_WORDS)


def _redact_query(query: str) -> str:
    pieces = []
    for piece in query.split("&"):
        name, equals, _ = piece.partition("=")
        pieces.append(f"{name}={REDACTED}" if equals and _is_secret(name) else piece)
    return "&".join(pieces)


def redact_url(url: str) -> str:
    """``url`` without its credentials: userinfo becomes ``***@``, a secret query value ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not even a URL (an unclosed IPv6 bracket): all up to the last "@" goes
        start = url.find("//") + 2
        if start >= 2 and "@" in url[start:]:
            url = f"{url[:start]}{REDACTED}{url[url.rindex('@') :]}"
        return _redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    elif ("@" in url and not _port_is_valid(netloc)) or (":" in netloc and "@" in parts.path):
        # "user:pa/ss@host": a password with an unencoded "/", "?" or "#" ends the netloc early,
        # so what looks like a port is the password's start; cut to the first "@" after "//"
        start = url.find("//") + 2
        return _redact_text(f"{url[:start]}{REDACTED}{url[url.index('@', start) :]}")
    return urlunsplit((parts.scheme, netloc, parts.path, _redact_query(parts.query), parts.fragment))


def _port_is_valid(netloc: str) -> bool:
    host_and_port = netloc.rpartition("]")[2]  # an IPv6 literal's colons are not a port's
    port = host_and_port.partition(":")[2] if ":" in host_and_port else ""
    return port == "" or (port.isascii() and port.isdigit())


def _redact_text(text: str) -> str:
    text = _USERINFO.sub(rf"\g<1>{REDACTED}@", text)

    def query_value(match: re.Match[str]) -> str:
        separator, name, value = match.groups()
        return f"{separator}{name}={REDACTED if _is_secret(name) else value}"

    return _SECRET_IN_QUERY.sub(query_value, text)


def redact_urls_in(text: str, urls: Iterable[str] = ()) -> str:
    """``text`` with each of ``urls`` (and anything else that looks like a URL's credentials)
    redacted: for error messages that may quote a URL, as some HTTP libraries' do."""
    for url in sorted(set(urls), key=len, reverse=True):
        if url:
            text = text.replace(url, redact_url(url))
    return _redact_text(text)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message with the credentials of any URL in it redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_logger(name: str) -> None:
    """Make the logger ``name`` redact URL credentials in its records (once; more calls do nothing)."""
    target = logging.getLogger(name)
    if not any(isinstance(existing, RedactingFilter) for existing in target.filters):
        target.addFilter(RedactingFilter())


def redacted_repr(value: object) -> str:
    """``repr(value)`` with no credential in it, for the repr of a settings field (``attrs.field(
    repr=redacted_repr)``): URLs in it redacted (also inside tuples, lists and mappings), and the
    value of a mapping's key that names a secret (``api_key``, ``client_secret``, ``token``, ...)
    shown as ``'***'`` whatever it holds."""
    if isinstance(value, str):
        return repr(redact_url(value) if "//" in value else value)
    if isinstance(value, Mapping):
        items = (
            f"{key!r}: {_secret_repr(item) if _names_a_secret(key) else redacted_repr(item)}"
            for key, item in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, tuple | list):
        inner = ", ".join(redacted_repr(item) for item in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)  # numbers, paths, attrs classes (whose own repr redacts what they hold)


def _names_a_secret(key: object) -> bool:
    """Whether an option's name says its value is a secret: it ends with one of
    ``SECRET_OPTION_ENDINGS`` (``api_key``, ``apiKey``, ``client_secret``, ``access_token``), so
    ``token_latency_s`` or ``max_tokens`` is shown."""
    if not isinstance(key, str):
        return False
    folded = key.lower().replace("-", "").replace("_", "")
    return folded.endswith(SECRET_OPTION_ENDINGS)


def _secret_repr(value: object) -> str:
    """A secret's repr: ``'***'``, or ``None`` for one not set (that much is no secret)."""
    return "None" if value is None else repr(REDACTED)
