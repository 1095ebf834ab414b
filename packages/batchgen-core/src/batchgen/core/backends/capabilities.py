"""What a backend can serve: its endpoints and the optional request features it honours.

A backend declares a ``capabilities`` attribute (a ``Capabilities``); one that declares none (an
older third-party backend) serves chat and completions without the optional features, which is
what every backend did before these existed. This module is the one place that decides whether a
request line can run on a backend: upload validation asks it for every line, and the executor
passes a backend only the options it declares.

Features are body fields a backend must honour rather than ignore: ``response_format``
(structured output), ``logprobs`` (also ``top_logprobs``), ``n`` (several choices),
``dimensions`` (embeddings), ``logit_bias`` (transformers applies it; an openai upstream gets it),
``frequency_penalty`` and ``presence_penalty`` (transformers applies them, sglang runs them, an
openai upstream gets them), and OpenAI's fields that no built-in model runs itself: ``tools``
(also ``functions``, ``tool_choice``, ``function_call``), ``echo``, ``suffix`` and ``best_of``
(completions), ``audio`` (also ``modalities`` other than text) and ``web_search_options``. A line
that uses one (with a value that changes the answer: a penalty of 0, ``logit_bias: {}`` or
``tool_choice: "none"`` use none) on a backend that does not declare it is refused at upload with
a 400 naming the line, never run with the field silently dropped.
``/v1/responses`` lines run on the chat path, so a backend serving chat serves them too.
"""

from __future__ import annotations

import operator
from typing import Any

import attrs

from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES

RESPONSE_FORMAT = "response_format"
LOGPROBS = "logprobs"
CHOICES = "n"
DIMENSIONS = "dimensions"
LOGIT_BIAS = "logit_bias"
FREQUENCY_PENALTY = "frequency_penalty"
PRESENCE_PENALTY = "presence_penalty"
TOOLS = "tools"
ECHO = "echo"
SUFFIX = "suffix"
BEST_OF = "best_of"
AUDIO = "audio"
WEB_SEARCH = "web_search_options"
FEATURES = (
    RESPONSE_FORMAT,
    LOGPROBS,
    CHOICES,
    DIMENSIONS,
    LOGIT_BIAS,
    FREQUENCY_PENALTY,
    PRESENCE_PENALTY,
    TOOLS,
    ECHO,
    SUFFIX,
    BEST_OF,
    AUDIO,
    WEB_SEARCH,
)
#: The sampling features an OpenAI-compatible upstream applies when they are passed on.
#: (The transformers backend applies all three itself; sglang the penalties.)
UPSTREAM_SAMPLING = frozenset({LOGIT_BIAS, FREQUENCY_PENALTY, PRESENCE_PENALTY})
#: What a backend answers the same way every time (``Capabilities.deterministic``), so that the
#: result cache (``result_cache_keys``) may replay it: greedy requests (and embeddings), and
#: requests with an explicit ``seed``.
GREEDY = "greedy"
SEEDED = "seed"


@attrs.frozen
class Capabilities:
    """The endpoints a backend serves and the optional features it honours."""

    endpoints: frozenset[str] = frozenset({CHAT_COMPLETIONS, COMPLETIONS})
    features: frozenset[str] = frozenset()
    #: The most choices (``n``) one line may ask for; None: no limit of the backend's own.
    max_choices: int | None = None
    #: What the backend repeats exactly (``GREEDY``, ``SEEDED``); nothing: never cached.
    deterministic: frozenset[str] = frozenset()

    def serves(self, endpoint: str) -> bool:
        if endpoint == RESPONSES:
            return CHAT_COMPLETIONS in self.endpoints
        return endpoint in self.endpoints

    @property
    def served_endpoints(self) -> tuple[str, ...]:
        """Every endpoint a batch line may use on this backend, in a stable order."""
        order = (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, EMBEDDINGS)
        return tuple(endpoint for endpoint in order if self.serves(endpoint))


#: What a backend that declares nothing serves.
TEXT_ONLY = Capabilities()
#: Chat and completions with every generation feature passed through (openai, sglang).
TEXT_WITH_FEATURES = Capabilities(features=frozenset({RESPONSE_FORMAT, LOGPROBS, CHOICES}))


def capabilities_of(backend: Any) -> Capabilities:
    """The backend's declared capabilities, or chat and completions only."""
    declared = getattr(backend, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else TEXT_ONLY


def features_used(endpoint: str, body: Any) -> list[str]:
    """The optional features a decoded line body asks for (``n: 1`` and ``logprobs: false`` do not)."""
    used: list[str] = []
    if endpoint == EMBEDDINGS:
        if getattr(body, "dimensions", None) is not None:
            used.append(DIMENSIONS)
        return used
    if getattr(body, "response_format", None) not in (None, {"type": "text"}):
        used.append(RESPONSE_FORMAT)
    logprobs = getattr(body, "logprobs", None)
    if logprobs not in (None, False, 0) or getattr(body, "top_logprobs", None) is not None:
        used.append(LOGPROBS)
    if getattr(body, "n", None) not in (None, 1):
        used.append(CHOICES)
    others = _other_fields(body)
    if others.count(None) != len(others):  # most bodies set none of them
        used.extend(feature for feature, fields in _FIELDS.items() if _fields_set(feature, fields, body))
    return used


def _other_fields(body: Any) -> tuple[Any, ...]:
    """The values of the body's fields of the features in ``_FIELDS`` (one look per body type)."""
    kind = type(body)
    getter = _getters.get(kind)
    if getter is None:
        present = getattr(kind, "__struct_fields__", None)
        names = [name for fields in _FIELDS.values() for name in fields]
        if present is not None:
            names = [name for name in names if name in present]
        getter = _getters[kind] = lambda body: tuple(getattr(body, name, None) for name in names)
        if present is not None and len(names) > 1:
            getter = _getters[kind] = operator.attrgetter(*names)
    return getter(body)


_getters: dict[type, Any] = {}


#: The body fields of each feature below ``n``, and the values that ask for nothing.
_FIELDS: dict[str, tuple[str, ...]] = {
    LOGIT_BIAS: (LOGIT_BIAS,),
    FREQUENCY_PENALTY: (FREQUENCY_PENALTY,),
    PRESENCE_PENALTY: (PRESENCE_PENALTY,),
    TOOLS: ("tools", "functions", "tool_choice", "function_call"),
    ECHO: (ECHO,),
    SUFFIX: (SUFFIX,),
    BEST_OF: (BEST_OF,),
    AUDIO: ("audio", "modalities"),
    WEB_SEARCH: (WEB_SEARCH,),
}


def _asks(name: str, value: Any, body: Any) -> bool:
    """Whether field ``name`` holding ``value`` asks for something (a default asks for nothing)."""
    if value is None:
        return False
    if name == BEST_OF:
        return bool(value != (getattr(body, "n", None) or 1))
    if name in ("tool_choice", "function_call"):
        return value not in ("none", "auto")
    if name == "modalities":
        return bool(value != ["text"])
    if name in (FREQUENCY_PENALTY, PRESENCE_PENALTY):
        return bool(value != 0)
    if name in ("audio", WEB_SEARCH):
        return True  # even {} turns them on
    return bool(value)  # logit_bias {}, tools [], functions [], suffix "", echo false: nothing


def _fields_set(feature: str, fields: tuple[str, ...], body: Any) -> list[str]:
    """The fields of ``feature`` the body sets to a value that asks for something."""
    return [name for name in fields if _asks(name, getattr(body, name, None), body)]


def unsupported_problem(
    model: str, backend_name: str, capabilities: Capabilities, endpoint: str, body: Any
) -> str | None:
    """Why a line cannot run on the model, or None when it can."""
    if not capabilities.serves(endpoint):
        served = ", ".join(capabilities.served_endpoints) or "none"
        return f"model {model!r} ({backend_name} backend) does not serve {endpoint}; it serves {served}"
    missing = [feature for feature in features_used(endpoint, body) if feature not in capabilities.features]
    if missing:
        named = [
            name
            for feature in missing
            for name in (_fields_set(feature, _FIELDS[feature], body) if feature in _FIELDS else [feature])
        ]
        fields = ", ".join(f"'body.{name}'" for name in named)
        return (
            f"{fields}: model {model!r} ({backend_name} backend) does not support "
            f"{' or '.join(missing)}; remove the field or use a model whose backend supports it"
        )
    choices = getattr(body, "n", None)
    if (
        capabilities.max_choices is not None
        and isinstance(choices, int)
        and choices > capabilities.max_choices
    ):
        return (
            f"'body.n': model {model!r} ({backend_name} backend) gives at most "
            f"{capabilities.max_choices} choices per line, got {choices}"
        )
    return None


def unsupported_problems(
    model: str, backend_name: str, capabilities: Capabilities, endpoint: str, body: Any
) -> list[tuple[str, str]]:
    """Every reason a line cannot run on the model, as (the body field it is about, the message):
    the endpoint not served (``body.model``), and else one for each field asking for a feature the
    backend does not run, and ``n`` over its most choices. Empty when the line can run there; the
    line is refused exactly when ``unsupported_problem`` gives a reason."""
    if not capabilities.serves(endpoint):
        return [("body.model", unsupported_problem(model, backend_name, capabilities, endpoint, body) or "")]
    problems: list[tuple[str, str]] = []
    for feature in features_used(endpoint, body):
        if feature in capabilities.features:
            continue
        for name in _feature_fields(feature, body):
            problems.append(
                (
                    f"body.{name}",
                    f"'body.{name}': model {model!r} ({backend_name} backend) does not support {feature}; "
                    "remove the field or use a model whose backend supports it",
                )
            )
    choices = getattr(body, "n", None)
    if (
        all(param != "body.n" for param, _ in problems)
        and capabilities.max_choices is not None
        and isinstance(choices, int)
        and choices > capabilities.max_choices
    ):
        problems.append(
            (
                "body.n",
                f"'body.n': model {model!r} ({backend_name} backend) gives at most "
                f"{capabilities.max_choices} choices per line, got {choices}",
            )
        )
    return problems


def _feature_fields(feature: str, body: Any) -> list[str]:
    """The body fields that ask for ``feature``: ``logprobs`` and ``top_logprobs`` each that is set
    for logprobs, the feature's own field for the others without fields of their own."""
    if feature in _FIELDS:
        return _fields_set(feature, _FIELDS[feature], body)
    if feature == LOGPROBS:
        named = [
            name
            for name, value in (
                ("logprobs", getattr(body, "logprobs", None)),
                ("top_logprobs", getattr(body, "top_logprobs", None)),
            )
            if value not in (None, False, 0) or (name == "top_logprobs" and value is not None)
        ]
        return named or [LOGPROBS]
    return [feature]


def passed_options(capabilities: Capabilities, endpoint: str, body: Any) -> dict[str, Any]:
    """The line's feature fields the backend declares, to hand it in ``GenerationRequest.options``."""
    options: dict[str, Any] = {}
    for feature in features_used(endpoint, body):
        if feature not in capabilities.features:
            continue
        if feature == LOGPROBS:
            logprobs = getattr(body, "logprobs", None)
            options["logprobs"] = True if logprobs is None else logprobs
            if getattr(body, "top_logprobs", None) is not None:
                options["top_logprobs"] = body.top_logprobs
        else:
            options[feature] = getattr(body, feature)
    return options
