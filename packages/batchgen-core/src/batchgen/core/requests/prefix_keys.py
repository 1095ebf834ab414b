"""What "a prompt prefix" is: the 64-bit key of the leading part of what the engine will see.

Engines with a prefix cache (vLLM, SGLang) reuse the work of a prompt's leading tokens when a
later prompt starts with the same tokens. Two uses need to know which requests share such a start:
the intake pool admits a batch's lines of one key together (``scheduling.prefix_groups``), and the
``openai`` backend sends the requests of one key to the same upstream (``upstream_concurrency``).

The key is a hash of the first ``PREFIX_CHARS`` characters of the request as a **stream**:

- chat (and ``/v1/responses`` lines, as the chat messages they run as): each message in order as
  its role, its content's text (a list of parts: the text parts' text; other parts as their JSON)
  and any other fields as sorted JSON, with separators that no text can forge (a message's
  content cannot end early and a role cannot run into the next message);
- completions: the prompt;
- the model name first, so one prompt for two models has two keys;
- embeddings and anything else: no key (None).

``line_prefix_key`` reads the key of a batch input line, where the batch's lines are indexed
(``batch_file.index_batch_file``, the one read of the file when a batch starts); the ``openai``
backend computes the same function from the request it is given (``prefix_key``).

Why a fixed share of the stream, not "every message but the last": the common batch shapes put
the shared part in different places (a long system prompt then the item in a user message; or one
user message that starts with the instructions and examples and ends with the item). Taking the
leading ``PREFIX_CHARS`` characters, whatever message they lie in, groups both the same way. 512
characters is about 128 tokens of English, so lines share a key exactly when they share at least
that long a start, which is when a prefix cache saves something worth grouping for; a workload of
200 prefixes of 400 tokens (1,600 or so characters each) followed by the items groups perfectly,
whatever its message layout. Prompts that share their first 512 characters but differ later get
one key: they are grouped, and still share those 128 tokens' cache. A shorter shared start (a
one-line system prompt before distinct items) gives distinct keys and so the file order, which is
what a workload with no shared prefix must keep.

Unrelated prompts collide only through the hash: 64 bits of BLAKE2b (stable across processes and
restarts, unlike Python's ``hash``, so a prefix keeps its upstream), about one pair in 2**64.
A key collision only makes two groups one; it never changes what runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES
from batchgen.core.requests.responses_api import chat_messages

__all__ = ["PREFIX_CHARS", "chat_prefix_key", "line_prefix_key", "prefix_key", "prompt_prefix_key"]

#: How many leading characters of a request's stream its key covers (about 128 tokens).
PREFIX_CHARS = 512

_encode_sorted = msgspec.json.Encoder(order="sorted").encode
# Separators: a control character that JSON-escaped parts never contain, and that a role, a
# model name or a text could only forge by containing it; ``_message_text`` escapes them in text.
_FIELD = "\x1f"
_MESSAGE = "\x1e"


def _hash(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)  # fits array("q")


def _escaped(text: str) -> str:
    if _FIELD in text or _MESSAGE in text:
        return text.replace(_FIELD, "\\x1f").replace(_MESSAGE, "\\x1e")
    return text


def _content_text(content: Any, room: int) -> str:
    """The text of a message's content, its first ``room`` characters at least."""
    if isinstance(content, str):
        return _escaped(content[:room])
    if isinstance(content, list):
        parts = []
        for part in content:
            if room <= 0:
                break
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                text = _escaped(part["text"][:room])
            else:
                text = _encode_sorted(part).decode()
            parts.append(text)
            room -= len(text)
        return "".join(parts)
    return "" if content is None else _encode_sorted(content).decode()


def _stream(model: str | None, messages: Iterable[Any]) -> str:
    """The leading ``PREFIX_CHARS`` characters of a chat request's stream (built only that far)."""
    pieces = [_escaped(model or ""), _MESSAGE]
    size = len(pieces[0]) + 1
    for message in messages:
        room = PREFIX_CHARS - size
        if room <= 0:
            break
        if isinstance(message, Mapping):
            content = message.get("content")
            text = _escaped(content[:room]) if type(content) is str else _content_text(content, room)
            piece = _escaped(str(message.get("role"))) + _FIELD + text + _FIELD
            if len(message) > ("role" in message) + ("content" in message):  # other fields
                rest = {key: value for key, value in message.items() if key not in ("role", "content")}
                piece += _encode_sorted(rest).decode()
        else:
            piece = _encode_sorted(message).decode()
        pieces.append(piece)
        pieces.append(_MESSAGE)
        size += len(piece) + 1
    return "".join(pieces)[:PREFIX_CHARS]


def chat_prefix_key(model: str | None, messages: Iterable[Any]) -> int:
    """The key of a chat request: ``model`` and its messages (dicts as in the request body)."""
    return _hash(_stream(model, messages))


def prompt_prefix_key(model: str | None, prompt: str) -> int:
    """The key of a completions request: ``model`` and its prompt."""
    return _hash((_escaped(model or "") + _FIELD + prompt[:PREFIX_CHARS])[:PREFIX_CHARS])


def prefix_key(model: str | None, *, messages: Iterable[Any] | None = None, prompt: Any = None) -> int | None:
    """The key of a request with ``messages`` (chat) or ``prompt`` (completions); None for
    anything else (embeddings, or neither given)."""
    if messages is not None:
        return chat_prefix_key(model, messages)
    if isinstance(prompt, str):
        return prompt_prefix_key(model, prompt)
    return None


class _PrefixBody(msgspec.Struct):
    """The fields of a line's body its key is made from (the others are skipped unread)."""

    model: Any = None
    messages: Any = None
    prompt: Any = None
    instructions: Any = None
    input: msgspec.Raw = msgspec.Raw(b"null")


class _PrefixLine(msgspec.Struct):
    url: str = ""
    body: _PrefixBody = msgspec.field(default_factory=_PrefixBody)


_decode_line = msgspec.json.Decoder(_PrefixLine).decode
_decode_any = msgspec.json.Decoder().decode


def line_prefix_key(raw: bytes) -> int | None:
    """The key of one batch input line's request (as the engine will see it: a ``/v1/responses``
    line as the chat messages it runs as); None for an embeddings line, or a line that cannot be
    read (upload validation has refused those; a key is never a reason to fail)."""
    try:
        line = _decode_line(raw)
        body = line.body
        model = body.model if isinstance(body.model, str) else None
        if line.url == CHAT_COMPLETIONS and isinstance(body.messages, list):
            return chat_prefix_key(model, body.messages)
        if line.url == COMPLETIONS:
            return prefix_key(model, prompt=body.prompt)
        if line.url == RESPONSES:
            instructions = body.instructions if isinstance(body.instructions, str) else None
            return chat_prefix_key(model, chat_messages(instructions, _decode_any(body.input)))
    except (msgspec.MsgspecError, InvalidRequest, TypeError, ValueError):
        return None
    return None
