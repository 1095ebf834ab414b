"""The core's layout: subpackages that import one way, and the old flat import paths still working.

The import graph is read from the source (``ast``), between "units": each subpackage of
``batchgen.core`` is one unit, each module at its top is one. Imports under ``if TYPE_CHECKING:``
are left out (they are not run).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import batchgen.core
from batchgen.core.moved_modules import MOVED

CORE = Path(batchgen.core.__file__).parent

#: The subpackages, each importing only those before it (and the modules at the top).
LAYERS = ("requests", "storage", "work", "backends", "files", "scheduling", "batches", "execution")
#: The top-level modules that may import subpackages: the facade and the old-path shim.
FACADE = frozenset({"__init__", "service", "moved_modules"})


def _unit(module: str) -> str:
    """``batches.tracker`` -> ``batches``; ``models`` -> ``models``."""
    return module.split(".")[0]


def _imports(path: Path) -> Iterator[str]:
    """The ``batchgen.core`` modules ``path`` imports when it runs (relative to the core)."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(inner) for inner in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "batchgen.core":
                names = [f"batchgen.core.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith("batchgen.core."):
                yield name.removeprefix("batchgen.core.")


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in CORE.rglob("*.py"):
        relative = path.relative_to(CORE).with_suffix("")
        unit = relative.parts[0]
        targets = graph.setdefault(unit, set())
        for imported in _imports(path):
            other = _unit(imported)
            if other != unit and ((CORE / other).is_dir() or (CORE / f"{other}.py").is_file()):
                targets.add(other)
    return graph


def test_the_unit_graph_has_no_cycle() -> None:
    graph = _unit_graph()
    done: set[str] = set()

    def visit(unit: str, path: tuple[str, ...]) -> None:
        assert unit not in path, f"import cycle: {' -> '.join((*path, unit))}"
        if unit in done:
            return
        for other in sorted(graph.get(unit, ())):
            visit(other, (*path, unit))
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, ())


def test_subpackages_import_only_those_below_them() -> None:
    graph = _unit_graph()
    subpackages = {path.name for path in CORE.iterdir() if (path / "__init__.py").is_file()}
    assert subpackages == set(LAYERS), "a subpackage was added or removed: place it in LAYERS"
    for position, unit in enumerate(LAYERS):
        above = set(LAYERS[position:]) - {unit}
        assert not graph[unit] & above, f"{unit} imports {sorted(graph[unit] & above)}, above it"
    for unit, targets in graph.items():
        if unit in subpackages or unit.removesuffix(".py") in FACADE:
            continue
        # a module at the top is a foundation every subpackage may use: storage is all it may use
        assert targets & subpackages <= {"storage"}, f"{unit} imports {sorted(targets & subpackages)}"


def test_the_top_folder_holds_the_foundation_not_the_families() -> None:
    modules = sorted(path.stem for path in CORE.glob("*.py"))
    families = [name for name in modules if name.startswith(("batch_", "request_", "line_", "file_"))]
    assert families == []
    assert len(modules) <= 16, modules


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_import_path_is_the_module_of_its_new_path(old: str, new: str) -> None:
    assert not (CORE / f"{old}.py").exists()
    assert importlib.import_module(f"batchgen.core.{old}") is importlib.import_module(f"batchgen.core.{new}")


def test_patching_through_an_old_path_changes_what_the_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.core.files import batch_file

    monkeypatch.setattr("batchgen.core.batch_file.VALIDATION_BLOCK_BYTES", 17)
    assert batch_file.VALIDATION_BLOCK_BYTES == 17


@pytest.mark.live
def test_old_paths_work_in_a_fresh_interpreter() -> None:
    """``from batchgen.core.OLD import name`` as the first import of a process (nothing loaded)."""
    code = (
        "from batchgen.core.batch_tracker import BatchTracker\n"
        "from batchgen.core import request_schema\n"
        "import batchgen.core.storage_faults as faults\n"
        "import batchgen.core.batches.tracker as tracker, batchgen.core.storage.faults as new\n"
        "assert BatchTracker is tracker.BatchTracker and faults is new\n"
        "assert request_schema.__name__ == 'batchgen.core.requests.schema'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_unknown_module_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("batchgen.core.batch_nothing")
