"""Command-line text into values, for the `batchgen` command's options.

Each converter raises `argparse.ArgumentTypeError`, so argparse reports a bad value as a usage
error naming the option (exit status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = [
    "key_value",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]


def key_value(text: str) -> tuple[str, str]:
    """`KEY=VALUE` as a pair; the value may itself hold `=`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _number(convert: Callable[[str], Any], check: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, lambda n: n > 0, "a positive integer")
non_negative_int = _number(int, lambda n: n >= 0, "an integer >= 0")
positive_float = _number(float, lambda x: x > 0, "a positive number")
non_negative_float = _number(float, lambda x: x >= 0, "a number >= 0")


#: The orders a batch's result files can be in (`output_order`).
OUTPUT_ORDERS = ("completion", "input")


def output_order(text: str) -> str:
    """`completion` or `input`, the orders a batch's result files can be in."""
    if text not in OUTPUT_ORDERS:
        raise argparse.ArgumentTypeError(f"expected 'completion' or 'input', got {text!r}")
    return text
