"""The modules and tests that tests/conftest.py marks by name (``live``, ``slow``) exist.

A renamed test or module would drop out of its list silently: a slow test would come back into the
fast loop, a process-starting one would fail there. Each listed module is a file, and each listed
test is defined in its module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import LIVE_MODULES, LIVE_TESTS, SLOW_MODULES, SLOW_TESTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", sorted(LIVE_MODULES | SLOW_MODULES))
def test_a_listed_module_exists(module: str) -> None:
    assert (ROOT / module).is_file(), f"tests/conftest.py lists {module}, which does not exist"


@pytest.mark.parametrize("test_id", sorted(LIVE_TESTS | SLOW_TESTS))
def test_a_listed_test_is_defined_in_its_module(test_id: str) -> None:
    module, name = test_id.split("::")
    source = (ROOT / module).read_text(encoding="utf-8")
    definition = rf"^(?:(?:async )?def {re.escape(name)}\(|class {re.escape(name)}\b|{re.escape(name)} = )"
    assert re.search(definition, source, re.MULTILINE), (
        f"tests/conftest.py lists {test_id}, which {module} does not define"
    )
