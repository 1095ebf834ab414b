"""The Hypothesis profiles scale every test's example count, and an unknown profile is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import PROFILE_VARIABLE, examples, profile


@pytest.mark.parametrize(
    ("name", "count", "expected"),
    [("ci", 200, 200), ("dev", 200, 40), ("dev", 3, 2), ("dev", 1, 1), ("nightly", 30, 300)],
)
def test_a_profile_scales_the_count_a_test_names(
    monkeypatch: pytest.MonkeyPatch, name: str, count: int, expected: int
) -> None:
    monkeypatch.setenv(PROFILE_VARIABLE, name)
    assert examples(count) == expected


def test_ci_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_VARIABLE, raising=False)
    assert profile() == "ci" and examples(150) == 150


def test_an_unknown_profile_is_refused_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILE_VARIABLE, "weekly")
    with pytest.raises(ValueError, match="dev, ci, nightly"):
        profile()


drawn: list[int] = []


@settings(max_examples=examples(30), database=None)
@given(st.integers())
def _draw(value: int) -> None:
    drawn.append(value)


def test_the_loaded_profile_sets_how_many_examples_a_test_draws() -> None:
    drawn.clear()
    _draw()
    assert 1 < len(drawn) <= examples(30)
