"""Development sessions for the BatchGen monorepo.

nox -s tests    the whole test suite (live servers on 127.0.0.1, the openai SDK, Hypothesis)
nox -s lint     ruff and mypy over the three packages and the tests
nox -s serve    run batchgen-server (arguments after -- are passed to it)
nox -s bench    run the benchmarks in benchmarks/ (arguments after -- go to each)
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_venv = "yes"

PYTHON = "3.11"
PACKAGES = ("packages/batchgen-core", "packages/batchgen-server", "packages/batchgen-client")
CONSTRAINTS = ("-c", "constraints.txt")
TEST_DEPS = ("pytest", "hypothesis", "openai", "anyio")


def _install_packages(session: nox.Session, *extra: str) -> None:
    editable = [arg for package in PACKAGES for arg in ("-e", package)]
    session.install(*CONSTRAINTS, *editable, *extra)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite; pass pytest arguments after --."""
    _install_packages(session, *TEST_DEPS)
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy."""
    _install_packages(session, "ruff", "mypy", *TEST_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run(
        "mypy", "packages/batchgen-core/src", "packages/batchgen-server/src", "packages/batchgen-client/src"
    )


@nox.session(python=PYTHON)
def serve(session: nox.Session) -> None:
    """Start batchgen-server on 127.0.0.1:10900; pass server flags after --."""
    session.install(*CONSTRAINTS, "-e", PACKAGES[0], "-e", PACKAGES[1])
    session.run("batchgen-server", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmarks; each prints its figures and, last, one JSON line."""
    _install_packages(session)
    session.run("python", "benchmarks/control_plane.py", *session.posargs)
