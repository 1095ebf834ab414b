"""The parameters a batch is created with besides its input file and endpoint, defined once.

Each field of `BatchOptions` is one parameter of `POST /v1/batches`: its name (the JSON field,
the keyword of `create_batch` and `submit_batch` on both faces, and, dashed, the flag of
`batchgen submit`), its type, its default, and how the command line takes it (`Flag`). The
signatures of `create_batch` and `submit_batch` name the same parameters, and a test holds them
to these fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from batchgen.client._arguments import key_value, output_order, positive_int

__all__ = ["DEFAULT_COMPLETION_WINDOW", "BatchOptions", "Flag", "flag_of"]

DEFAULT_COMPLETION_WINDOW = "24h"


@dataclass(frozen=True, slots=True)
class Flag:
    """How `batchgen submit` takes one option: `--<name-with-dashes> VALUE`."""

    parse: Callable[[str], Any]
    """The value from its text (raising argparse.ArgumentTypeError if it is not one)."""
    metavar: str
    help: str
    pairs: bool = False
    """Given once per KEY=VALUE pair; the pairs make one dict."""


_FLAG = "batchgen.flag"


def _option(default: Any, flag: Flag) -> Any:
    return field(default=default, metadata={_FLAG: flag})


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """What a batch is created with beyond its input and endpoint; None means the server's default."""

    completion_window: str = _option(
        DEFAULT_COMPLETION_WINDOW,
        Flag(
            str,
            "WINDOW",
            f"time the batch may take, such as 30m or 2h (default: {DEFAULT_COMPLETION_WINDOW})",
        ),
    )
    metadata: Mapping[str, str] | None = _option(
        None, Flag(key_value, "KEY=VALUE", "batch metadata (repeatable)", pairs=True)
    )
    max_decoding_length: int | None = _option(None, Flag(positive_int, "N", "batch token limit"))
    temperature: float | None = _option(None, Flag(float, "T", "sampling temperature"))
    top_p: float | None = _option(None, Flag(float, "P", "nucleus sampling probability"))
    top_k: int | None = _option(None, Flag(int, "K", "top-k sampling"))
    output_order: str | None = _option(
        None,
        Flag(
            output_order,
            "ORDER",
            "'input': the result files end in input-line order; 'completion': as requests finish "
            "(default: the server's, normally completion)",
        ),
    )

    def body(self) -> dict[str, Any]:
        """These options as fields of the POST /v1/batches body; those left None are omitted."""
        values = {option.name: getattr(self, option.name) for option in fields(self)}
        if self.metadata is not None:
            values["metadata"] = dict(self.metadata)
        return {name: value for name, value in values.items() if value is not None}


def flag_of(option: Field[Any]) -> Flag:
    """The command-line flag of one field of `BatchOptions`."""
    flag = option.metadata[_FLAG]
    assert isinstance(flag, Flag)
    return flag
