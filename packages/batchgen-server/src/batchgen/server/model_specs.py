"""The models a server serves, from ``--model NAME=SPEC`` flags or a ``--models-config`` TOML file.

A model spec names a backend and its options::

    --model chat=transformers:model=/models/qwen,device=cuda
    --model emb=embeddings
    --model big=openai:upstream=http://10.0.0.5:30000/v1,upstream=http://10.0.0.6:30000/v1

``NAME`` is what request lines put in ``model``; ``BACKEND`` is an installed backend
(``batchgen-server --help`` lists them); each ``KEY=VALUE`` sets one of that backend's options,
named by its keyword (``model``, ``max_batch_size``, ``upstreams``) or its flag without the dashes
(``upstream``, ``embedding-model``); ``path`` is another name for ``model``. A repeatable option
(``upstream``) may be given several times. The same in a TOML file::

    [[models]]
    name = "chat"
    backend = "transformers"
    model = "/models/qwen"
    aliases = ["gpt-4o-mini"]   # more names the model answers to

    [[models]]
    name = "emb"
    backend = "embeddings"

The first model is the default (a line's ``"model": "default"`` or none). A ``--model`` value
not of the form ``NAME=BACKEND[:...]`` with an installed backend keeps its old meaning: the model
path of ``--backend transformers`` or ``sglang``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from batchgen.core.backends import BackendOption, BackendSpec
from batchgen.core.backends.served_models import names_tuple
from batchgen.core.url_redaction import redacted_repr

_SPEC = re.compile(r"^(?P<name>[^=\s,]+)=(?P<backend>[a-z][a-z0-9_-]*)(?::(?P<options>.*))?$", re.DOTALL)
#: Option keys that name another option (``path`` for ``model``).
_KEY_ALIASES = {"path": "model"}


@attrs.frozen
class ModelEntry:
    """One model to serve: its name, its backend's name, that backend's options, more names."""

    name: str
    backend: str
    #: Its repr hides credentials (an upstream's userinfo, an API key): settings get logged.
    options: Mapping[str, Any] = attrs.field(factory=dict, repr=redacted_repr)
    aliases: tuple[str, ...] = attrs.field(default=(), converter=names_tuple)


def is_model_spec(text: str, backend_names: Sequence[str]) -> bool:
    """Whether a ``--model`` value is a ``NAME=BACKEND[:OPTIONS]`` spec (else a model path)."""
    match = _SPEC.match(text)
    return match is not None and match["backend"] in backend_names


def _option(spec: BackendSpec, key: str) -> BackendOption:
    key = _KEY_ALIASES.get(key, key)
    for option in spec.options:
        names = {option.keyword, *(flag[2:] for flag in option.flags)}
        if key in names or key.replace("_", "-") in names:
            return option
    known = ", ".join(option.keyword for option in spec.options) or "none"
    raise ValueError(f"the {spec.name} backend has no option {key!r}; its options: {known}")


def _parse_value(option: BackendOption, value: Any, where: str) -> Any:
    try:
        parsed = option.type(str(value)) if not isinstance(value, bool) else value
    except ValueError as exc:
        raise ValueError(f"{where}: invalid value {value!r} for {option.keyword}: {exc}") from None
    if option.choices is not None and parsed not in option.choices:
        raise ValueError(f"{where}: {option.keyword} must be one of {option.choices}, got {value!r}")
    return parsed


def _options(spec: BackendSpec, pairs: Sequence[tuple[str, Any]], where: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in pairs:
        option = _option(spec, key)
        values = value if isinstance(value, list) else [value]
        if option.repeatable:
            options[option.keyword] = (
                *options.get(option.keyword, ()),
                *(_parse_value(option, item, where) for item in values),
            )
        elif isinstance(value, list) or option.keyword in options:
            raise ValueError(f"{where}: {option.keyword} is given more than once")
        else:
            options[option.keyword] = _parse_value(option, value, where)
    return options


def parse_model_spec(text: str, specs: Mapping[str, BackendSpec]) -> ModelEntry:
    """A ``--model NAME=BACKEND[:KEY=VALUE,...]`` value; ValueError saying what is wrong."""
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(f"--model {text!r} is not NAME=BACKEND[:KEY=VALUE,...]")
    spec = specs.get(match["backend"])
    if spec is None:
        raise ValueError(f"--model {text!r}: no backend {match['backend']!r}; installed: {', '.join(specs)}")
    pairs: list[tuple[str, Any]] = []
    for item in filter(None, (match["options"] or "").split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"--model {text!r}: option {item!r} is not KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return ModelEntry(match["name"], spec.name, _options(spec, pairs, f"--model {match['name']}"))


def load_models_config(path: str | Path, specs: Mapping[str, BackendSpec]) -> list[ModelEntry]:
    """The ``[[models]]`` of a TOML file; ValueError naming the file and entry on a problem."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--models-config {path}: {exc}") from None
    entries = document.get("models")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-config {path}: needs at least one [[models]] table")
    models: list[ModelEntry] = []
    for position, table in enumerate(entries, start=1):
        where = f"--models-config {path}, model {position}"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: must be a table")
        fields = dict(table)
        name, backend = fields.pop("name", None), fields.pop("backend", None)
        aliases = fields.pop("aliases", [])
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: needs a 'name'")
        if not isinstance(backend, str) or backend not in specs:
            raise ValueError(
                f"{where} ({name}): 'backend' must be one of {', '.join(specs)}, got {backend!r}"
            )
        if not isinstance(aliases, list) or not all(isinstance(alias, str) for alias in aliases):
            raise ValueError(f"{where} ({name}): 'aliases' must be a list of strings")
        options = _options(specs[backend], list(fields.items()), f"{where} ({name})")
        models.append(ModelEntry(name, backend, options, tuple(aliases)))
    return models


def check_unique_names(models: Sequence[ModelEntry]) -> None:
    """ValueError when two models share a name or alias."""
    seen: set[str] = set()
    for model in models:
        for name in (model.name, *model.aliases):
            if name in seen or name == "default":
                raise ValueError(f"model name {name!r} is used twice (or is the reserved 'default')")
            seen.add(name)
