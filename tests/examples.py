"""How many examples a Hypothesis test draws: the count it names, scaled by the run's profile.

A test writes ``@settings(max_examples=examples(200))``: 200 is what the whole suite (``nox -s
tests``, and CI) draws. ``BATCHGEN_HYPOTHESIS_PROFILE`` picks the profile (``tests/conftest.py``
loads Hypothesis's own settings profile of that name too):

``ci``       the counts as written (the default)
``dev``      a fifth of each, at least 2: a quick look while editing
``nightly``  ten times each: a long search, for a run nobody waits on
"""

from __future__ import annotations

import os

PROFILE_VARIABLE = "BATCHGEN_HYPOTHESIS_PROFILE"
SCALES = {"dev": 0.2, "ci": 1.0, "nightly": 10.0}


def profile() -> str:
    """The profile this run uses; ValueError naming the choices for an unknown one."""
    name = os.environ.get(PROFILE_VARIABLE, "ci")
    if name not in SCALES:
        raise ValueError(f"{PROFILE_VARIABLE}={name!r}: choose one of {', '.join(SCALES)}")
    return name


def examples(count: int) -> int:
    """``count`` examples scaled by this run's profile (never below 2, nor below ``count`` if smaller)."""
    return max(min(count, 2), round(count * SCALES[profile()]))
