"""``batchgen-server`` flags made from the backends' declared options, and option values read back.

Each installed backend gets a ``--help`` group with a flag per ``BackendOption``. An option whose
flags several backends declare (``--model``/``--model-path`` for transformers and sglang) is one
flag, shown in the group of the first backend declaring it, with each backend's help; those
backends must agree on its flags, type, default and whether it repeats.

The backends that ship with ``batchgen-core`` are laid out first, the default one leading. A
backend whose flags clash with the server's own flags or with a backend laid out before it is
left out, with the reason, so one badly made package cannot take the server down.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from batchgen.core.backends import BackendOption, BackendSpec

_PLAIN_TYPES: tuple[Callable[[str], Any], ...] = (str, int, float)


def command_line_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes a usage error that shows the message."""
    if parse in _PLAIN_TYPES:
        return parse  # argparse says "invalid int value: 'x'" itself

    def parse_argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {exc}") from exc

    parse_argument.__name__ = getattr(parse, "__name__", "value")
    return parse_argument


def help_with_default(text: str, default: object) -> str:
    """``text`` with ``(default: ...)`` appended once, unless there is no default to show."""
    escaped = text.replace("%", "%%")
    if default is None or default == () or default == []:
        return escaped
    return f"{escaped} (default: {str(default).replace('%', '%%')})"


def dest(option: BackendOption) -> str:
    """Where argparse keeps an option's value; the same for every backend sharing its flags."""
    return "backend_flag" + min(option.flags).replace("-", "_")


def backend_options(args: argparse.Namespace, spec: BackendSpec) -> dict[str, object]:
    """The parsed value of each of ``spec``'s options, by the factory's keyword."""
    values: dict[str, object] = {}
    for option in spec.options:
        value = getattr(args, dest(option))
        values[option.keyword] = tuple(value or ()) if option.repeatable else value
    return values


def add_backend_flags(
    parser: argparse.ArgumentParser,
    specs: Sequence[BackendSpec],
    *,
    default_backend: str,
    problems: dict[str, str],
) -> list[BackendSpec]:
    """Add a group of flags per backend; return the backends laid out, in order.

    A backend left out is recorded in ``problems`` with the reason.
    """
    reserved = set(parser._option_string_actions)
    shared: dict[str, list[tuple[str, BackendOption]]] = {}  # flag -> (backend, option) declaring it
    laid_out: list[BackendSpec] = []
    for spec in sorted(specs, key=lambda spec: _layout_key(spec, default_backend)):
        clash = _clash(spec, reserved, shared)
        if clash is not None:
            problems[spec.name] = clash
            continue
        laid_out.append(spec)
        for option in spec.options:
            for flag in option.flags:
                shared.setdefault(flag, []).append((spec.name, option))
    for spec in laid_out:
        group = parser.add_argument_group(
            f"{spec.name} backend" + (" (the default)" if spec.name == default_backend else ""),
            _description(spec, shared),
        )
        for option in spec.options:
            declarations = shared[option.flag]
            if declarations[0][0] == spec.name:
                _add_flag(group, option, declarations)
    return laid_out


def _layout_key(spec: BackendSpec, default_backend: str) -> tuple[bool, bool, str]:
    built_in = (getattr(spec.factory, "__module__", None) or "").startswith("batchgen.core.")
    return (spec.name != default_backend, not built_in, spec.name)


def _clash(
    spec: BackendSpec, reserved: set[str], shared: dict[str, list[tuple[str, BackendOption]]]
) -> str | None:
    """Why ``spec``'s flags cannot be added, or None."""
    for option in spec.options:
        for flag in option.flags:
            if flag in reserved:
                return f"its option {flag} is also a flag of batchgen-server itself"
            if flag not in shared:
                continue
            owner, other = shared[flag][0]
            same = (
                set(option.flags) == set(other.flags)
                and option.type is other.type
                and option.default == other.default
                and option.repeatable == other.repeatable
                and option.choices == other.choices
            )
            if not same:
                return (
                    f"its option {flag} differs from the {owner} backend's {flag} "
                    "(flags, type, default, choices and repetition must agree to share a flag)"
                )
    return None


def _description(spec: BackendSpec, shared: dict[str, list[tuple[str, BackendOption]]]) -> str:
    elsewhere = [option.flag for option in spec.options if shared[option.flag][0][0] != spec.name]
    text = spec.summary
    if elsewhere:
        text += f"; also takes {', '.join(elsewhere)} (above)"
    return text


def _default_note(option: BackendOption) -> str | None:
    if option.required:
        return "required"
    if option.default_help is not None:
        return f"default: {option.default_help}"
    if option.default is None or option.default == ():
        return None
    return f"default: {option.default}"


def _help(declarations: list[tuple[str, BackendOption]]) -> str:
    if len(declarations) == 1:
        [(_, option)] = declarations
        note = _default_note(option)
        return option.help + (f" ({note})" if note else "")
    notes = [_default_note(option) for _, option in declarations]
    if len(set(notes)) == 1:  # one default for all: say it once, at the end
        parts = [f"{backend}: {option.help}" for backend, option in declarations]
        return "; ".join(parts) + (f" ({notes[0]})" if notes[0] else "")
    # backends that say the same (help and default) are named together, so each default shows once
    same: dict[tuple[str, str | None], list[str]] = {}
    for (backend, option), note in zip(declarations, notes, strict=True):
        same.setdefault((option.help, note), []).append(backend)
    return "; ".join(
        f"{', '.join(backends)}: {text}" + (f" ({note})" if note else "")
        for (text, note), backends in same.items()
    )


def _add_flag(
    group: argparse._ArgumentGroup, option: BackendOption, declarations: list[tuple[str, BackendOption]]
) -> None:
    keywords: dict[str, Any] = {
        "dest": dest(option),
        "type": command_line_type(option.type),
        "help": _help(declarations).replace("%", "%%"),
    }
    if option.repeatable:
        keywords.update(action="append", default=None)
    else:
        keywords["default"] = option.default
    if option.choices is not None:
        keywords["choices"] = option.choices
    keywords["metavar"] = option.metavar or option.flag[2:].upper().replace("-", "_")
    group.add_argument(*option.flags, **keywords)
