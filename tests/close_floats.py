"""Compare JSON values the way model outputs may be compared: equal, but floats only within a
tolerance.

Two batch rows (two choices of one request, a line alone and inside a padded batch) compute the
same numbers in a different order, and the order changes the last bits; how many bits depends on
the dtype the CPU runs the model in (bfloat16 with native support, else float32). Tests compare
tokens and texts exactly and logprobs and vectors with ``close_json``.
"""

from __future__ import annotations

import math
from typing import Any

#: Logprobs of one token computed in two batch rows differed by about 1e-6 in float32 (SmolLM2,
#: the greedy choices of one line); bfloat16 keeps about three significant digits, so the
#: tolerance is well above what either gives and well below what another token would.
LOGPROB_TOLERANCE = 5e-2


def close_json(first: Any, second: Any, abs_tol: float = LOGPROB_TOLERANCE, path: str = "") -> list[str]:
    """Where ``first`` and ``second`` differ (paths), treating floats within ``abs_tol`` as equal."""
    if isinstance(first, bool) or isinstance(second, bool):
        return [] if first == second else [path or "$"]
    if isinstance(first, int | float) and isinstance(second, int | float):
        return [] if math.isclose(first, second, rel_tol=0, abs_tol=abs_tol) else [path or "$"]
    if isinstance(first, dict) and isinstance(second, dict):
        if set(first) != set(second):
            return [f"{path or '$'} keys"]
        return [
            difference
            for key in first
            for difference in close_json(first[key], second[key], abs_tol, f"{path}.{key}")
        ]
    if isinstance(first, list) and isinstance(second, list):
        if len(first) != len(second):
            return [f"{path or '$'} length"]
        return [
            difference
            for index, (one, other) in enumerate(zip(first, second, strict=True))
            for difference in close_json(one, other, abs_tol, f"{path}[{index}]")
        ]
    return [] if first == second else [path or "$"]
