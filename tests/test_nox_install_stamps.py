"""noxfile.py installs a step's requirements once (again only when what they depend on changes), and
serve waits for the server's clean stop on Ctrl-C.

``_install`` skips pip in a reused environment whose stamp for the step (a hash of its pip
arguments, constraints.txt and the packages' pyproject.toml files) matches, and shows pip's own
output when it does install. The noxfile is loaded with a minimal stand-in for the ``nox`` module
(the test environments do not install nox); the function under test is the noxfile's own, run in
a copy of the files it reads.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

ROOT = Path(__file__).resolve().parents[1]


def _load_noxfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    stand_in = types.ModuleType("nox")
    stand_in.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stand_in.session = lambda **_: lambda function: function  # type: ignore[attr-defined]
    stand_in.Session = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", stand_in)
    spec = importlib.util.spec_from_file_location("batchgen_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Session:
    """What ``_install`` uses of a nox session: its environment's folder, log and install."""

    def __init__(self, location: Path, *, fail: bool = False, no_install: bool = False) -> None:
        self.virtualenv = types.SimpleNamespace(location=str(location))
        self._runner = types.SimpleNamespace(global_config=types.SimpleNamespace(no_install=no_install))
        self.installs: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.logs: list[str] = []
        self.fail = fail

    def log(self, text: str) -> None:
        self.logs.append(text)

    def install(self, *args: str, **options: Any) -> None:
        if self.fail:
            raise RuntimeError("pip failed")
        self.installs.append((args, options))


PACKAGES = ("batchgen-core", "batchgen-server", "batchgen-client")
STAMPED = [
    "constraints.txt",
    "constraints-vllm.txt",
    *(f"packages/{package}/pyproject.toml" for package in PACKAGES),
]


def _copy_stamped_files(root: Path) -> Path:
    """A copy of the files the stamps read, under ``root``."""
    for name in STAMPED:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    return root


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stamped files, in the current folder (nox runs from the repository root)."""
    monkeypatch.chdir(_copy_stamped_files(tmp_path))
    return tmp_path


def test_a_second_install_of_the_same_step_skips_pip(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    noxfile = _load_noxfile(monkeypatch)
    session = Session(project / "venv")
    noxfile._install(session, "step", "-c", "constraints.txt", "pytest")
    noxfile._install(session, "step", "-c", "constraints.txt", "pytest")
    assert len(session.installs) == 1
    assert session.installs[0][1]["silent"] is False  # pip's progress is shown
    assert "already installed" in session.logs[-1]
    noxfile._install(session, "other step", "-c", "constraints.txt", "pytest", "httpx")
    assert len(session.installs) == 2  # other requirements: installed


@settings(max_examples=examples(10), deadline=None)
@given(which=st.sampled_from(STAMPED), text=st.text(min_size=1, max_size=20))
def test_a_change_to_the_pins_or_a_packages_metadata_installs_again(
    tmp_path_factory: pytest.TempPathFactory, which: str, text: str
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        root = _copy_stamped_files(tmp_path_factory.mktemp("project"))
        monkeypatch.chdir(root)
        noxfile = _load_noxfile(monkeypatch)
        session = Session(root / "venv")
        noxfile._install(session, "step", "-e", "packages/batchgen-core")
        with open(root / which, "a", encoding="utf-8") as changed:
            changed.write(f"\n# {text!r}\n")
        noxfile._install(session, "step", "-e", "packages/batchgen-core")
        assert len(session.installs) == 2


def test_a_failed_install_leaves_no_stamp(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    noxfile = _load_noxfile(monkeypatch)
    with pytest.raises(RuntimeError):
        noxfile._install(Session(project / "venv", fail=True), "step", "pytest")
    session = Session(project / "venv")
    noxfile._install(session, "step", "pytest")
    assert len(session.installs) == 1


def test_no_install_stamps_nothing(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nox --no-install makes session.install do nothing in a reused environment: no stamp then."""
    noxfile = _load_noxfile(monkeypatch)
    noxfile._install(Session(project / "venv", no_install=True), "step", "pytest")
    session = Session(project / "venv")
    noxfile._install(session, "step", "pytest")
    assert len(session.installs) == 1


@pytest.mark.parametrize(
    ("posargs", "grace_s"),
    [([], 10.0), (["--port", "8000", "--shutdown-grace-s", "30"], 30.0), (["--shutdown-grace-s=2.5"], 2.5)],
)
def test_serve_waits_for_the_servers_clean_stop(
    project: Path, monkeypatch: pytest.MonkeyPatch, posargs: list[str], grace_s: float
) -> None:
    """On Ctrl-C nox gives the server (which got the signal too) its whole shutdown before it would
    send SIGTERM, so a clean stop, exit 0, is the session's result (nox's default is 0.3 s)."""
    noxfile = _load_noxfile(monkeypatch)
    runs: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    session = Session(project / "venv")
    session.posargs = posargs  # type: ignore[attr-defined]
    session.run = lambda *args, **options: runs.append((args, options))  # type: ignore[attr-defined]
    noxfile.serve(session)
    [(args, options)] = runs
    assert args == ("batchgen-server", *posargs)
    assert options["interrupt_timeout"] > grace_s and options["terminate_timeout"] > grace_s
