"""Shared fixtures: in-process and live servers, and the ``live`` marker with its guard.

Two ways to reach a server:

* ``api`` / ``api_factory``: the real Litestar app (``create_app``) with the simulated backend, a
  real SQLite file and real files under ``tmp_path``, driven in this process by Litestar's
  ``TestClient`` (an ``httpx.Client``). Flags are the ``batchgen-server`` command's own.
* ``live_server`` / ``server_factory``: real ``batchgen-server`` processes on 127.0.0.1
  (``tests.live``), for what needs a process: signals, a real port, ``curl``, other programs.

A test that starts any process (a server, ``transformers serve``, ``curl``, the ``batchgen``
command, a fresh Python) is marked ``live``: automatically when it uses a live fixture or sits in
one of ``LIVE_MODULES``, else by hand or in ``LIVE_TESTS``. A test that is not marked ``live``
and starts a process anyway fails, so ``pytest -m "not live"`` (``nox -s unit``) runs exactly
the tests that need no process, and none is left out by mistake.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from litestar import Litestar
from litestar.testing import TestClient

from batchgen.server.app import create_app
from batchgen.server.cli import settings_from_args
from tests.examples import SCALES, profile
from tests.live import LiveServer, start_server
from tests.postgres import PostgresServer
from tests.seaweedfs import SeaweedServer
from tests.tiny_model import VLLM_HEAD_DIM, build_tiny_model

# Hypothesis judges what a test asserts, never how long one example takes: on two shared cores
# (CI, or a suite beside other work) an example can take seconds, and a per-example deadline or a
# "too slow" health check would fail a correct test. Each test's own settings still apply on top;
# the profile (BATCHGEN_HYPOTHESIS_PROFILE: dev, ci, nightly; tests/examples.py) scales the number
# of examples, of the tests that name theirs (``examples(N)``) and of those that do not (100).
for _name, _scale in SCALES.items():
    settings.register_profile(
        _name,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
        max_examples=round(100 * _scale),
    )
settings.load_profile(profile())

#: Fixtures that start ``batchgen-server`` processes: a test using one is ``live``.
#: ``postgres_server`` and ``postgres_url`` start a real PostgreSQL (``tests.postgres``),
#: ``seaweed_server`` a real S3 server (``tests.seaweedfs``).
LIVE_FIXTURES = frozenset(
    {"live_server", "server_factory", "echo_site", "postgres_server", "postgres_url", "seaweed_server"}
)
#: Fixtures that need torch and transformers: a test using one is ``model``.
MODEL_FIXTURES = frozenset({"tiny_model"})
#: Modules (not edited here) whose every test starts a process of its own.
LIVE_MODULES = frozenset(
    {
        "tests/client/test_cli.py",  # runs the `batchgen` command, mostly against a live server
        "tests/client/test_client_live.py",  # live servers, some started by the test itself
        "tests/server/test_openai_upstream_server.py",  # `transformers serve` upstreams
    }
)
#: Single tests (in modules not edited here) that start a fresh Python.
LIVE_TESTS = frozenset(
    {
        "tests/client/test_client_mock.py::test_importing_the_client_is_light",
        "tests/core/test_sglang_backend.py::test_importing_and_building_the_backend_does_not_import_sglang",
        "tests/core/test_backend_registry.py::test_listing_and_loading_every_backend_imports_no_engine",
    }
)


#: In-process modules whose tests each take seconds (webhook deliveries and their retries, batches
#: run under a real database lock, engines kept busy on purpose): ``slow``, in ``nox -s tests`` and
#: out of the fast loop.
SLOW_MODULES = frozenset(
    {
        "tests/server/test_webhooks.py",
        "tests/server/test_locked_running_batch.py",
        "tests/core/test_engine_activity.py",
        "tests/server/test_malformed_lines.py",  # a hundred files and uploads, each a request or five
    }
)
#: Single in-process tests of 2 s or more on two CPU cores (pytest --durations): ``slow`` too. A
#: test class (a Hypothesis state machine's TestCase) is named by its class.
SLOW_TESTS = frozenset(
    {
        "tests/core/test_scheduling_state_machines.py::TestSchedulerMachine",
        "tests/core/test_model_shares.py::TestModelSharesMachine",
        "tests/core/test_service_totals.py::test_the_totals_equal_the_sum_of_every_batch_s_counts",
        "tests/core/test_batch_file_validation.py::test_accepting_lines_at_once_decides_as_the_exact_way",
        "tests/core/test_backend_contract.py::test_aborting_requests_of_a_group_aborts_exactly_those",
        "tests/core/test_guide_conventions.py::test_a_batch_out_of_time_ends_as_the_convention_says",
        "tests/core/test_tenancy.py::test_every_caller_sees_exactly_what_it_may",
        "tests/server/test_backpressure.py::test_full_intake_pool_gives_429_then_accepts_after_draining",
        "tests/server/test_durability.py::test_files_expire_and_free_their_disk",
        "tests/server/test_durability.py::test_batch_past_its_window_ends_with_partial_results",
        "tests/server/test_batch_retry.py::test_an_expired_batch_retries_the_lines_that_never_ran",
        "tests/server/test_batch_retry.py::test_a_retry_holds_exactly_the_lines_that_failed_or_never_ran",
        "tests/core/test_deadline_watch.py::test_a_batch_that_cannot_finish_in_time_is_at_risk_with_one_event_across_a_restart",
        "tests/core/test_metadata_calls.py::test_sqlite_is_called_in_place_as_before",
        "tests/core/test_metadata_calls.py::test_a_store_that_blocks_is_called_from_worker_threads_and_the_loop_never_waits",
        "tests/server/test_result_cache.py::test_a_second_run_of_10000_greedy_lines_comes_from_the_cache_byte_for_byte",
        "tests/server/test_connection_limits.py::test_a_request_under_way_at_shutdown_is_cut_with_503_when_the_grace_ends",
        "tests/server/test_dashboard.py::test_after_a_restart_the_totals_count_only_the_new_work",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``live`` every test that uses a live fixture or is listed above, ``model`` every test
    that uses a model fixture, ``slow`` every test listed as slow."""
    for item in items:
        module = item.path.relative_to(config.rootpath).as_posix()
        test_id = f"{module}::{item.name.split('[')[0]}"
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & LIVE_FIXTURES or module in LIVE_MODULES or test_id in LIVE_TESTS:
            item.add_marker(pytest.mark.live)
        if fixtures & MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)
        parts = item.nodeid.split("::")  # module::Class::test for a test in a class
        test_class = f"{module}::{parts[1]}" if len(parts) > 2 else None
        if module in SLOW_MODULES or test_id in SLOW_TESTS or test_class in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    items.sort(key=_module_rank(items))


def _module_rank(items: list[pytest.Item]) -> Callable[[pytest.Item], int]:
    """Modules with model tests first, then modules that start processes, then the rest, each
    module's tests kept in their order: pytest-xdist hands out whole modules in this order, so
    the longest ones start early instead of leaving one worker busy at the end while the others
    wait."""
    rank: dict[Path, int] = {}
    for item in items:
        own = 0 if item.get_closest_marker("model") else 1 if item.get_closest_marker("live") else 2
        rank[item.path] = min(rank.get(item.path, 2), own)
    return lambda item: rank[item.path]


#: Audit events raised when a process is started.
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty"}
)


class _ProcessGuard:
    """An audit hook failing any attempt to start a process while a test not marked ``live`` runs."""

    def __init__(self) -> None:
        self.test: str | None = None

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.test is not None and event in _PROCESS_EVENTS:
            raise RuntimeError(
                f"{self.test} started a process ({event} {args[:2]!r}) but is not marked live: "
                "mark it with @pytest.mark.live, or list it in tests/conftest.py"
            )


_process_guard = _ProcessGuard()
sys.addaudithook(_process_guard)  # audit hooks cannot be removed; the guard is off between tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _process_guard.test = None if item.get_closest_marker("live") else item.nodeid
    try:
        return (yield)
    finally:
        _process_guard.test = None


def in_process_app(storage_path: Path, *flags: str) -> Litestar:
    """The app ``batchgen-server --backend simulated --storage-path … FLAGS`` would serve."""
    storage_path.mkdir(parents=True, exist_ok=True)
    argv = ["--backend", "simulated", "--storage-path", str(storage_path), *flags]
    return create_app(settings_from_args(argv))


@pytest.fixture
def api_factory(tmp_path: Path) -> Iterator[Callable[..., TestClient[Litestar]]]:
    """In-process servers with the given flags and storage ``tmp_path / storage``, stopped after the test."""
    with ExitStack() as stack:

        def make(*flags: str, storage: str = "storage") -> TestClient[Litestar]:
            app = in_process_app(tmp_path / storage, *flags)
            return stack.enter_context(TestClient(app, timeout=30))

        yield make


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient[Litestar]]:
    """One in-process server with the default flags, shared by a test module."""
    app = in_process_app(tmp_path_factory.mktemp("api") / "storage")
    with TestClient(app, timeout=30) as client:
        yield client


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start ``batchgen-server`` processes with custom flags; each is stopped at the end of the test."""
    servers: list[LiveServer] = []

    def make(*flags: str, storage: str = "storage", ready: tuple[int, ...] = (200,)) -> LiveServer:
        server = start_server(tmp_path / storage, *flags, ready=ready)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the whole run, started on first use."""
    server = PostgresServer.start()
    yield server
    server.stop()
    server.remove()


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[SeaweedServer]:
    """One real S3-compatible server (SeaweedFS) for the whole run, started on first use."""
    server = SeaweedServer.start()
    yield server
    server.stop()
    server.remove()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a fresh database of its own for one test."""
    return postgres_server.new_database()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One default ``batchgen-server`` process (simulated backend) shared by a test module."""
    server = start_server(tmp_path_factory.mktemp("live") / "storage")
    yield server
    server.stop()


#: The fake ``sglang`` package (SGLang needs CUDA) and the knobs it reads from the environment.
FAKE_SGLANG = Path(__file__).resolve().parent / "fakes"
FAKE_SGLANG_KNOBS = (
    "FAKE_SGLANG_DELAY_S",
    "FAKE_SGLANG_DIE_AFTER",
    "FAKE_SGLANG_FAIL_START",
    "FAKE_SGLANG_RECORD",
)


@pytest.fixture
def fake_sglang_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The fake ``sglang`` on the PYTHONPATH that server processes inherit, with none of its knobs
    set; the monkeypatch, to set some."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_SGLANG), os.environ.get("PYTHONPATH")]))
    )
    for name in FAKE_SGLANG_KNOBS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight model folder (tests/tiny_model.py); needs the torch extra."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with heads wide enough for vLLM's CPU attention (``VLLM_HEAD_DIM``)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-model"), head_dim=VLLM_HEAD_DIM)


#: The example third-party backend package that docs/backends-writing.md walks through.
ECHO_PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "batchgen-backend-echo"


@pytest.fixture(scope="session")
def echo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the example echo backend installed by pip, dist-info and all.

    Put it on ``sys.path`` (or ``PYTHONPATH``) and ``--backend echo`` is found through its entry
    point, as for any installed package. Built with this environment's hatchling, offline.
    """
    site = tmp_path_factory.mktemp("echo-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(ECHO_PACKAGE),
        ],
        check=True,
        timeout=300,
    )
    return site
