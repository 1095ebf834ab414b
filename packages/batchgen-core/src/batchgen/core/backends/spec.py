"""What a backend declares about itself: ``BackendSpec`` (its name, how to build it, its options).

A backend module ends with one ``BackendSpec``, and its package registers that object under the
``batchgen.backends`` entry-point group (see ``registry``)::

    [project.entry-points."batchgen.backends"]
    echo = "batchgen_echo:SPEC"

``BackendOption`` describes one keyword argument of the backend's factory that a user sets on
the command line: ``batchgen-server`` makes a flag of each (``--help`` shows one group per
backend) and passes the parsed value to the factory under ``keyword``. Options with the same
flags in several backends (``--model``) become one flag.

Loading a spec must stay cheap: a backend module imports its engine (torch, sglang, httpx) when
the backend starts, never at import time, because every ``batchgen-server --help`` imports every
installed backend module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs

from batchgen.core.backends.base import Backend

_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


def _check_flag(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not _FLAG.match(value):
        raise ValueError(f"{attribute.name} must look like --some-flag, got {value!r}")


@attrs.frozen
class BackendOption:
    """One option of a backend, settable with a flag of ``batchgen-server``.

    ``keyword``       the factory's keyword argument that receives the value
    ``flag``          the flag, e.g. ``--echo-prefix``; prefix it with the backend's name
    ``type``          parses one command-line string into the value (raise ValueError to refuse it)
    ``default``       the value when the flag is not given; keep it equal to the factory's default
    ``help``          one phrase for ``--help``, without the default (the server appends it)
    ``aliases``       more flags for the same option (``--model-path`` for ``--model``)
    ``choices``       the only values accepted, if any
    ``repeatable``    the flag may be given many times; the value is a tuple of parsed items
    ``metavar``       the placeholder ``--help`` shows for the value (``URL``, ``KEY=VALUE``)
    ``required``      the server refuses to build this backend without a value
    ``default_help``  how ``--help`` describes a default that is not a plain value
                      (``"cuda if present, else cpu"`` for a ``None`` that the backend resolves)
    """

    keyword: str = attrs.field(validator=attrs.validators.matches_re(r"^[A-Za-z_][A-Za-z0-9_]*$"))
    flag: str = attrs.field(validator=_check_flag)
    type: Callable[[str], Any] = str
    default: Any = None
    help: str = ""
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    repeatable: bool = False
    metavar: str | None = None
    required: bool = False
    default_help: str | None = None

    def __attrs_post_init__(self) -> None:
        for alias in self.aliases:
            _check_flag(self, attrs.fields(BackendOption).aliases, alias)
        if self.repeatable and self.default not in (None, ()):
            raise ValueError(
                f"{self.flag} is repeatable: its default is the empty tuple, not {self.default!r}"
            )

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag, then its aliases."""
        return (self.flag, *self.aliases)


@attrs.frozen
class BackendSpec:
    """A backend as ``batchgen-server`` and ``load_backend`` see it.

    ``name``                    what ``--backend`` and ``load_backend`` call it
    ``factory``                 builds the backend from keyword options (usually the class itself)
    ``summary``                 one phrase for ``--help``: what the backend runs
    ``options``                 the options the server makes flags of
    ``context_length_keyword``  the keyword that receives ``--max-context-length`` when it is given
                                (None: the backend takes no prompt limit)
    ``cache_dir_keyword``       the keyword that receives ``{storage}/models``, a folder for files
                                the backend derives from its model (None: it keeps none)
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(_NAME))
    factory: Callable[..., Backend]
    summary: str
    options: tuple[BackendOption, ...] = ()
    context_length_keyword: str | None = None
    cache_dir_keyword: str | None = None

    def __attrs_post_init__(self) -> None:
        keywords = [option.keyword for option in self.options]
        flags = [flag for option in self.options for flag in option.flags]
        for kind, values in (("keyword", keywords), ("flag", flags)):
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                raise ValueError(f"backend {self.name!r} declares the {kind} {repeated[0]} twice")

    def build(self, **options: Any) -> Backend:
        """A new backend built with ``options`` (the factory's keyword arguments)."""
        return self.factory(**options)
