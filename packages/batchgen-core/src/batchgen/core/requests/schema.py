"""The request schema: what one batch input line and its body may hold, for each endpoint.

Upload validation (``batch_file``) and execution (``execution.executor``, ``parameters``) read a
line only through ``read_envelope`` and ``read_body``, so a line that is accepted is exactly a
line that can run. A line is ``{"custom_id", "method": "POST", "url", "body"}``; its body is
decoded into the endpoint's struct: ``ChatBody`` (a non-empty ``messages`` list, each message an
object with a ``role`` of OpenAI's (``ROLES``) and ``content`` that is a string, null or a list of content parts,
a text part having a string ``text``) or ``CompletionBody`` (a string ``prompt``). Both read the
sampling fields of ``RequestBody``, whose types the structs fix and whose ranges
``sampling_ranges`` checks, as for a batch. OpenAI's fields that change the answer and that not
every backend runs (``logit_bias``, the penalties, tools, audio, ``echo``, ...) are typed here and
run or refused by ``backends.capabilities``, never ignored. Other body fields (OpenAI bodies have
many) are allowed and ignored, except the other endpoint's input field, which would be ambiguous.
Every line must also stay within the ``json_bounds`` (nesting depth, integer size).

``/v1/embeddings`` bodies are ``EmbeddingsBody`` (``embeddings_api`` checks ``input``,
``encoding_format`` and ``dimensions``); ``/v1/responses`` bodies are ``ResponsesBody``
(``responses_api`` checks ``input`` and refuses the features BatchGen does not run). Chat and
completion bodies may carry ``response_format`` (checked by ``structured_output``), ``logprobs``,
``top_logprobs`` and ``n``; whether the chosen model honours them is ``backends.capabilities``'s
decision, made at upload for every line.

To check many lines fast, ``block_reader`` decodes whole lines with the envelope's rules in the
types, and groups them by the body fields other than the input, whose verdict they share.

Problems are ``InvalidRequest`` whose message names the field (``'body.top_p' must be ...``) and
whose ``param`` is that field's path. ``read_envelope`` and ``read_body`` raise a line's first
problem; ``line_problems`` finds all of them, for every endpoint (upload validation reports every
one, with those of its later checks, the model's, put in the same order by ``in_field_order``).
"""

from __future__ import annotations

import operator
import re
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

import attrs
import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES, SUPPORTED_ENDPOINTS
from batchgen.core.requests.json_bounds import bounds_problem, integer_path
from batchgen.core.requests.json_escapes import escape_problem
from batchgen.core.requests.sampling_ranges import range_problem
from batchgen.core.requests.structured_output import response_format_problem


class ContentPart(Struct):
    """One part of a message's list content; a ``text`` part must carry a string ``text``.

    Other kinds of part (images, audio) are well formed here; a text-only backend answers them
    with an ``invalid_request`` error line.
    """

    type: str
    text: str | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.type == "text" and self.text is UNSET:
            raise ValueError("a text part needs a string 'text'")


#: The roles a chat message may have, as in OpenAI's API.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class Message(Struct):
    """One chat message: its ``role`` (one of ``ROLES``) and its content (a string, null or
    content parts)."""

    role: Role
    content: str | list[ContentPart] | None = None


assert typing.get_args(Role) == ROLES


class RequestBody(Struct):
    """The body fields every endpoint reads: the model, streaming, and the sampling parameters."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    response_format: Any = None
    # OpenAI sampling fields a backend applies only where it declares them (backends.capabilities)
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


class ChatBody(RequestBody):
    """A ``/v1/chat/completions`` body."""

    messages: list[Message] = msgspec.field(default_factory=list)
    prompt: Any = None  # refused: it belongs to /v1/completions
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # OpenAI fields no built-in backend runs: refused (backends.capabilities) unless they ask nothing
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionBody(RequestBody):
    """A ``/v1/completions`` body."""

    prompt: str | UnsetType = UNSET
    messages: Any = None  # refused: it belongs to /v1/chat/completions
    logprobs: int | None = None
    # OpenAI fields no built-in backend runs: refused (backends.capabilities) unless they ask nothing
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingsBody(Struct):
    """A ``/v1/embeddings`` body: ``input`` is checked by ``embeddings_api.read_inputs``."""

    input: Any = UNSET
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


class ResponsesBody(RequestBody):
    """A ``/v1/responses`` body: ``input`` (a string or message items) and ``instructions``.

    ``responses_api`` checks the input and refuses the fields of features BatchGen does not run
    (tools, stored conversation state, background mode); ``max_output_tokens`` is its output limit.
    """

    input: Any = UNSET
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    text: Any = None
    logprobs: Any = None  # not a Responses field; top_logprobs asks for them
    store: Any = None
    # refused by responses_api when set: features BatchGen does not run
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    include: Any = None
    prompt: Any = None
    reasoning: Any = None


class Envelope(Struct):
    """A request line around its body, which is decoded for its endpoint by ``read_body``."""

    custom_id: str
    method: str
    url: str
    body: Raw


#: The sampling fields checked against ``sampling_ranges``, in the order they are reported.
SAMPLING_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "top_logprobs",
    "max_output_tokens",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
)

_envelope_decoder = msgspec.json.Decoder(Envelope)
_body_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    CHAT_COMPLETIONS: msgspec.json.Decoder(ChatBody),
    COMPLETIONS: msgspec.json.Decoder(CompletionBody),
    EMBEDDINGS: msgspec.json.Decoder(EmbeddingsBody),
    RESPONSES: msgspec.json.Decoder(ResponsesBody),
}

#: What ``read_body`` returns, by endpoint.
Body = ChatBody | CompletionBody | EmbeddingsBody | ResponsesBody


def _sampling_getter(body_type: type[Struct]) -> tuple[tuple[str, ...], operator.attrgetter[Any]]:
    """The sampling fields a body type has, in ``SAMPLING_FIELDS`` order, and one getter of
    their values (a tuple: most bodies set none, which one look tells)."""
    names = tuple(name for name in SAMPLING_FIELDS if name in body_type.__struct_fields__)
    assert len(names) > 1  # so the getter gives a tuple
    return names, operator.attrgetter(*names)


_sampling_getters = {
    body_type: _sampling_getter(body_type) for body_type in (ChatBody, CompletionBody, ResponsesBody)
}
_any_decoder = msgspec.json.Decoder()

_AT_PATH = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_EXPECTED = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<more>[^,]*), got `(?P<got>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_KINDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "array": "a list",
    "object": "a JSON object",
}


def _kinds(names: str) -> str:
    return " or ".join(_KINDS.get(name.strip(), name.strip()) for name in names.split("|"))


def _problem(error: msgspec.MsgspecError, prefix: str) -> InvalidRequest:
    """An InvalidRequest naming the field of a msgspec error, in BatchGen's words."""
    match = _AT_PATH.match(str(error))
    assert match is not None  # the pattern matches any text
    text, path = match["text"], (match["path"] or "")
    field = (prefix + path).lstrip(".")
    if not isinstance(error, msgspec.ValidationError):
        return InvalidRequest(f"not valid JSON ({error})", param=field or None)
    if missing := _MISSING.match(text):
        name = f"{field}.{missing['field']}".lstrip(".")
        return InvalidRequest(f"missing '{name}'", param=name)
    if expected := _EXPECTED.match(text):
        wanted = _kinds(expected["expected"]) + expected["more"]
        if not field:
            return InvalidRequest(f"a line must be {wanted}", param=None)
        return InvalidRequest(f"'{field}' must be {wanted}, got {_kinds(expected['got'])}", param=field)
    if not field:
        return InvalidRequest(text, param=None)
    if text.startswith("Invalid enum value ") and field.endswith(".role"):
        got = text.removeprefix("Invalid enum value ")
        return InvalidRequest(
            f"'{field}' must be one of {', '.join(map(repr, ROLES))}, got {got}", param=field
        )
    return InvalidRequest(f"'{field}': {text}", param=field)


def read_envelope(raw: bytes, *, within_bounds: bool = False) -> Envelope:
    """The line ``raw`` (one line's bytes) without its body decoded; InvalidRequest if malformed.

    ``within_bounds``: the caller has checked the line against the JSON bounds already (a block
    of lines at once, ``json_bounds.lines_within_bounds``)."""
    too_big = None if within_bounds else bounds_problem(raw)
    if too_big is not None:
        path = integer_path(raw) if "integer" in too_big else None
        if path is not None:
            raise InvalidRequest(f"'{path}' holds {too_big}", param=path)
        raise InvalidRequest(too_big)
    try:
        envelope = _envelope_decoder.decode(raw)
    except msgspec.MsgspecError as exc:
        raise _decode_problem(raw, exc) from None
    if not envelope.custom_id:
        raise InvalidRequest("'custom_id' must be a non-empty string", param="custom_id")
    if envelope.method != "POST":
        raise InvalidRequest(f"'method' must be \"POST\", got {envelope.method!r}", param="method")
    if envelope.url not in SUPPORTED_ENDPOINTS:
        raise InvalidRequest(
            f"'url' must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {envelope.url!r}", param="url"
        )
    return envelope


def _decode_problem(raw: bytes, error: msgspec.MsgspecError) -> InvalidRequest:
    """The problem of a line that a decoder refused with ``error``."""
    escape = escape_problem(raw) if isinstance(error, msgspec.DecodeError) else None
    if escape is not None:  # the decoder's words for it depend on where it stopped
        return InvalidRequest(f"not valid JSON ({escape})")
    return _problem(error, "")


def read_body(envelope: Envelope) -> Body:
    """The envelope's body, decoded and checked for its endpoint; InvalidRequest naming the field."""
    try:
        body: Body = _body_decoders[envelope.url].decode(envelope.body)
    except msgspec.ValidationError as exc:
        if str(exc).startswith("Expected `object`") and " - at `" not in str(exc):
            raise InvalidRequest("'body' must be a JSON object", param="body") from None
        raise _problem(exc, "body") from None
    return check_body(body)


def check_body(body: Body) -> Body:
    """``body`` once the checks its struct cannot state pass; InvalidRequest naming the field (the
    first problem ``body_problems`` finds)."""
    for problem in body_problems(body):
        raise problem
    return body


def body_problems(body: Body) -> Iterator[InvalidRequest]:
    """Every problem of a decoded body that its struct cannot state, in the order of the checks."""
    if isinstance(body, EmbeddingsBody):
        from batchgen.core.requests.embeddings_api import embeddings_body_problems

        yield from embeddings_body_problems(body)
        return
    if isinstance(body, ResponsesBody):
        from batchgen.core.requests.responses_api import (
            CHAT_ONLY_FIELDS,
            responses_body_problems,
            responses_terms,
        )

        yield from responses_body_problems(body)
        for problem in _generation_problems(body):  # name the Responses fields, not the chat ones
            # the chat fields now hold what the Responses fields say (text.format, max_output_tokens),
            # which were checked as those: their problems are said already
            if _top_field(problem.param) not in CHAT_ONLY_FIELDS:
                yield InvalidRequest(responses_terms(problem.message), param=_responses_param(problem.param))
        return
    yield from _generation_problems(body)


def _responses_param(param: str | None) -> str | None:
    from batchgen.core.requests.responses_api import responses_terms

    return None if param is None else responses_terms(f"'{param}'").strip("'")


def _generation_problems(body: ChatBody | CompletionBody | ResponsesBody) -> Iterator[InvalidRequest]:
    """The checks a chat, completion or Responses body shares (its struct decoded it)."""
    if body.stream:
        yield InvalidRequest(
            "'body.stream' must be false or absent: batches do not stream (streaming_unsupported)",
            param="body.stream",
        )
    if isinstance(body, ChatBody):
        if not body.messages:
            yield InvalidRequest(
                "'body.messages' must be a non-empty list for /v1/chat/completions", param="body.messages"
            )
        if body.prompt is not None:
            yield InvalidRequest(
                "'body.prompt' belongs to /v1/completions; a /v1/chat/completions body takes 'messages'",
                param="body.prompt",
            )
    elif isinstance(body, CompletionBody):
        if body.prompt is UNSET:
            yield InvalidRequest("'body.prompt' must be a string for /v1/completions", param="body.prompt")
        if body.messages is not None:
            yield InvalidRequest(
                "'body.messages' belongs to /v1/chat/completions; a /v1/completions body takes 'prompt'",
                param="body.messages",
            )
    names, sampling_values = _sampling_getters[type(body)]
    values = sampling_values(body)
    if values.count(None) != len(values):  # most bodies set none
        for name, value in zip(names, values, strict=True):
            if value is None:
                continue
            problem = range_problem(name, value)
            if problem is not None:
                yield InvalidRequest(f"'body.{name}' {problem}", param=f"body.{name}")
    if isinstance(body, CompletionBody) and body.logprobs is not None and not 0 <= body.logprobs <= 5:
        yield InvalidRequest(
            f"'body.logprobs' must be an integer from 0 to 5 for /v1/completions, got {body.logprobs}",
            param="body.logprobs",
        )
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        yield InvalidRequest("'body.top_logprobs' needs 'body.logprobs': true", param="body.top_logprobs")
    if body.response_format is not None:
        problem = response_format_problem(body.response_format)
        if problem is not None:
            yield InvalidRequest(f"'body.response_format' {problem}", param="body.response_format")


@attrs.frozen
class LineReading:
    """What the request schema finds in one line (``line_problems``).

    ``problems`` is every problem, in the order of the line's fields (a missing field after the
    fields of its object that are there). ``custom_id`` and ``url`` are the line's when they are
    valid, else None; ``body`` holds the body's valid fields (every field when there is no problem
    in the body), or None when the body cannot be read at all.
    """

    custom_id: str | None
    url: str | None
    body: Body | None
    problems: tuple[InvalidRequest, ...]


_ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")
_MISSING_FIELD = 1 << 30  # where a missing field's problem sorts among its object's fields


def line_problems(raw: bytes) -> LineReading:
    """Every problem of the line ``raw`` that ``read_envelope`` and ``read_body`` would find one
    at a time; they accept the line exactly when ``problems`` is empty."""
    try:
        envelope = read_envelope(raw)
    except InvalidRequest as exc:
        first = exc
    else:
        try:
            return LineReading(envelope.custom_id, envelope.url, read_body(envelope), ())
        except InvalidRequest as exc:
            body = _any_decoder.decode(envelope.body)  # the envelope is right: the body is not
            if not isinstance(body, dict):
                return LineReading(envelope.custom_id, envelope.url, None, (exc,))
            return _body_reading(envelope.custom_id, envelope.url, body, ())
    if first.param is None or bounds_problem(raw) is not None:  # not JSON, not an object, too big
        return LineReading(None, None, None, (first,))
    try:
        line = _any_decoder.decode(raw)
    except msgspec.DecodeError as exc:  # a field of the wrong type came before the broken JSON
        return LineReading(None, None, None, (_decode_problem(raw, exc),))
    if not isinstance(line, dict):
        return LineReading(None, None, None, (first,))
    problems: list[tuple[int, InvalidRequest]] = []
    order = {key: index for index, key in enumerate(line)}
    values: dict[str, Any] = {}
    for name in _ENVELOPE_FIELDS:
        position = order.get(name, _MISSING_FIELD)
        if name not in line:
            problems.append((position, InvalidRequest(f"missing '{name}'", param=name)))
            continue
        value = line[name]
        problem = _envelope_field_problem(name, value)
        if problem is None:
            values[name] = value
        else:
            problems.append((position, problem))
    problems.sort(key=_FIRST)
    found = tuple(problem for _, problem in problems)
    url = values.get("url")
    if url is None or "body" not in values:
        return LineReading(values.get("custom_id"), url, None, found)
    return _body_reading(values.get("custom_id"), url, values["body"], found)


_FIRST = operator.itemgetter(0)


def in_field_order(raw: bytes, problems: Iterable[InvalidRequest]) -> list[InvalidRequest]:
    """``problems`` of the line ``raw`` (those ``line_problems`` found, and those of later checks:
    the model, a duplicate ``custom_id``) in the order ``line_problems`` reports them: the
    envelope's by the line's field order, then the body's by the body's field order (a missing
    field after those there); problems of one field keep their order."""
    found = list(problems)
    if len(found) < 2:
        return found
    try:
        line = _any_decoder.decode(raw)
    except msgspec.MsgspecError:
        return found
    if not isinstance(line, dict):
        return found
    envelope = {key: index for index, key in enumerate(line)}
    body = line.get("body")
    fields = {key: index for index, key in enumerate(body)} if isinstance(body, dict) else {}

    def position(problem: InvalidRequest) -> tuple[int, int]:
        param = problem.param
        if param is None:
            return (-1, 0)
        if param.startswith("body.") or param.startswith("body["):
            return (1, fields.get(_top_field(param), _MISSING_FIELD))
        return (0, envelope.get(param.split(".")[0].split("[")[0], _MISSING_FIELD))

    return sorted(found, key=position)


def _envelope_field_problem(name: str, value: Any) -> InvalidRequest | None:
    if name == "body":
        if not isinstance(value, dict):
            return InvalidRequest("'body' must be a JSON object", param="body")
        return None
    if not isinstance(value, str):
        return InvalidRequest(f"'{name}' must be a string, got {_json_kind(value)}", param=name)
    if name == "custom_id" and not value:
        return InvalidRequest("'custom_id' must be a non-empty string", param="custom_id")
    if name == "method" and value != "POST":
        return InvalidRequest(f"'method' must be \"POST\", got {value!r}", param="method")
    if name == "url" and value not in SUPPORTED_ENDPOINTS:
        return InvalidRequest(
            f"'url' must be one of {', '.join(SUPPORTED_ENDPOINTS)}, got {value!r}", param="url"
        )
    return None


def _json_kind(value: Any) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "array")):
        if isinstance(value, kind):
            return _KINDS[name]
    return _KINDS["null"] if value is None else _KINDS["object"]


_BODY_TYPES: dict[str, type[Struct]] = {
    CHAT_COMPLETIONS: ChatBody,
    COMPLETIONS: CompletionBody,
    EMBEDDINGS: EmbeddingsBody,
    RESPONSES: ResponsesBody,
}


def _body_reading(
    custom_id: str | None, url: str, body: Any, before: tuple[InvalidRequest, ...]
) -> LineReading:
    """The reading of a line whose ``url`` is valid and whose ``body`` is a JSON object (decoded
    as plain values), after the envelope's problems ``before``."""
    body_type = _BODY_TYPES[url]
    fields = {field.encode_name: field for field in msgspec.structs.fields(body_type)}
    order = {key: index for index, key in enumerate(body)}
    problems: list[tuple[int, InvalidRequest]] = []
    good: dict[str, Any] = {}
    for key, value in body.items():
        field = fields.get(key)
        if field is None:
            continue  # other fields are allowed and ignored
        found = list(_value_problems(value, field.type, f"body.{key}"))
        if found:
            problems.extend((order[key], problem) for problem in found)
        else:
            good[key] = value
    for field in fields.values():
        if field.required and field.encode_name not in body:
            name = f"body.{field.encode_name}"
            problems.append((_MISSING_FIELD, InvalidRequest(f"missing '{name}'", param=name)))
    try:
        decoded: Body = msgspec.convert(good, body_type)  # type: ignore[assignment]
    except msgspec.ValidationError:  # not expected: every field in it converted on its own
        return LineReading(custom_id, url, None, before + tuple(problem for _, problem in problems))
    wrong = {_top_field(problem.param) for _, problem in problems}
    for problem in body_problems(decoded):
        top = _top_field(problem.param)
        if top in wrong:
            continue  # its value was not of its type, which is said already
        problems.append((order.get(top, _MISSING_FIELD), problem))
    problems.sort(key=_FIRST)
    return LineReading(custom_id, url, decoded, before + tuple(problem for _, problem in problems))


def _top_field(param: str | None) -> str:
    """The body field a problem's ``param`` is in (``body.messages[0].role``: ``messages``)."""
    return (param or "").removeprefix("body.").split(".")[0].split("[")[0]


def _value_problems(value: Any, kind: Any, path: str) -> Iterator[InvalidRequest]:
    """Every problem of ``value`` as a value of type ``kind``: inside a list or a struct (a
    message, a content part), each element's and each field's, not only the first."""
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        first = _problem(exc, path)
    else:
        return
    inner = list(_inner_problems(value, kind, path))
    yield from inner or (first,)


def _inner_problems(value: Any, kind: Any, path: str) -> Iterator[InvalidRequest]:
    """The problems of the parts of ``value`` where ``kind`` is a list, a struct or a union holding
    one of those and ``value`` is of that shape; nothing otherwise."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        for member in typing.get_args(kind):
            member_origin = typing.get_origin(member) or member
            if (isinstance(value, list) and member_origin is list) or (
                isinstance(value, dict) and isinstance(member, type) and issubclass(member, Struct)
            ):
                yield from _inner_problems(value, member, path)
                return
        return
    if origin is list and isinstance(value, list):
        (item_kind,) = typing.get_args(kind)
        for index, item in enumerate(value):
            yield from _value_problems(item, item_kind, f"{path}[{index}]")
        return
    if isinstance(kind, type) and issubclass(kind, Struct) and isinstance(value, dict):
        fields = {field.encode_name: field for field in msgspec.structs.fields(kind)}
        found = False
        for key, item in value.items():
            if key in fields:
                for problem in _value_problems(item, fields[key].type, f"{path}.{key}"):
                    found = True
                    yield problem
        for name, field in fields.items():
            if field.required and name not in value:
                found = True
                yield InvalidRequest(f"missing '{path}.{name}'", param=f"{path}.{name}")
        if not found:  # the fields are right: a rule of the struct's own (a text part's text)
            return


class ChatLine(Struct):
    """A whole ``/v1/chat/completions`` line decoded at once (``line_decoder``)."""

    custom_id: str
    method: str
    url: str
    body: ChatBody


class CompletionLine(Struct):
    """A whole ``/v1/completions`` line decoded at once (``line_decoder``)."""

    custom_id: str
    method: str
    url: str
    body: CompletionBody


_line_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    CHAT_COMPLETIONS: msgspec.json.Decoder(ChatLine),
    COMPLETIONS: msgspec.json.Decoder(CompletionLine),
}


def line_decoder(url: str) -> msgspec.json.Decoder[Any] | None:
    """One decoder for a whole line of endpoint ``url``, envelope and body together: the fast way
    to check many lines (``batch_file``). A line it decodes, whose envelope fields are right and
    whose body ``check_body`` accepts, is a line ``read_envelope`` and ``read_body`` accept too;
    for any other line they say what is wrong. None for an endpoint without one (embeddings,
    responses: their lines are checked the exact way)."""
    return _line_decoders.get(url)


# The structs ``block_reader`` decodes into hold no reference cycles, so the garbage collector
# need not track them (gc=False): validation makes hundreds of them at once.


class _BlockContentPart(ContentPart, gc=False):
    pass


class _BlockMessage(Message, gc=False, kw_only=True):
    # the same type with untracked parts (nothing stores into it: list invariance does not bite)
    content: str | list[_BlockContentPart] | None = None  # type: ignore[assignment]


class _ChatBlockBody(ChatBody, gc=False, kw_only=True):
    """A chat body as ``block_reader`` reads it: ``messages`` required and non-empty, and last."""

    messages: Annotated[list[_BlockMessage], Meta(min_length=1)]  # type: ignore[assignment]


class _ChatBlockLine(Struct, gc=False):
    custom_id: Annotated[str, Meta(min_length=1)]
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: _ChatBlockBody


class _CompletionBlockBody(CompletionBody, gc=False, kw_only=True):
    """A completion body as ``block_reader`` reads it: ``prompt`` a required string, and last."""

    prompt: str


class _CompletionBlockLine(Struct, gc=False):
    custom_id: Annotated[str, Meta(min_length=1)]
    method: Literal["POST"]
    url: Literal["/v1/completions"]
    body: _CompletionBlockBody


@attrs.frozen
class BlockReader:
    """Reads the lines of one endpoint many at a time (``block_reader``).

    ``decoder`` decodes a whole line and refuses more than ``line_decoder``'s: an empty
    ``custom_id``, a ``method`` other than POST, another endpoint's ``url``, and a body without the
    field that holds its input (chat ``messages``, non-empty; completion ``prompt``, a string). A
    line it refuses may still be acceptable (or not): ask the exact way.

    ``shapes(lines)`` maps decoded lines to their shapes: every body field but the input field,
    as a tuple. Whether ``check_body`` and a model (``ModelSet.check_line``) accept a body the
    decoder decoded depends on its shape alone, so one line's verdict holds for every line of an
    equal shape: the decoder gives each typed field values of one type (a float field holds
    floats), and the untyped fields (``response_format``, a chat body's ``prompt``) are accepted
    only as null or an object. A shape holding a list or an object (a ``stop`` list, a
    ``response_format``) cannot be hashed (``batch_file`` compares those by their JSON). A rule that looks at the input field beyond what the
    decoder checks belongs in the decoder, or it would hold for one line of a shape only.
    """

    decoder: msgspec.json.Decoder[Any]

    def shapes(self, lines: list[Any]) -> Iterator[tuple[Any, ...]]:
        return map(_ALL_BUT_LAST, map(msgspec.structs.astuple, map(_BODY, lines)))


_BODY = operator.attrgetter("body")
_ALL_BUT_LAST = operator.itemgetter(slice(None, -1))
_block_readers = {
    CHAT_COMPLETIONS: BlockReader(msgspec.json.Decoder(_ChatBlockLine)),
    COMPLETIONS: BlockReader(msgspec.json.Decoder(_CompletionBlockLine)),
}
assert _ChatBlockBody.__struct_fields__[-1] == "messages"
assert _CompletionBlockBody.__struct_fields__[-1] == "prompt"


def block_reader(url: str) -> BlockReader | None:
    """The way to read many lines of endpoint ``url`` at once (``batch_file``), or None for an
    endpoint without one (embeddings, responses)."""
    return _block_readers.get(url)


def message_dicts(envelope: Envelope) -> tuple[dict[str, Any], ...]:
    """A chat line's messages as the plain objects it holds, every field kept (``name``,
    ``tool_calls``, ...) for chat templates and upstreams; call after ``read_body`` accepted it."""
    messages = _any_decoder.decode(envelope.body)["messages"]
    return tuple(messages)
