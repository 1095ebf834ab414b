"""A real PostgreSQL server for the tests, started from the machine's own binaries.

``PostgresServer.start`` runs ``initdb`` on a fresh folder and ``pg_ctl start`` on a free port of
127.0.0.1 (its socket in that folder too); ``new_database`` gives each test a database of its
own; ``restart`` (``pg_ctl restart -m immediate``, a crash for the clients), ``crash`` and
``resume`` (down for as long as a test likes) and ``stop`` are the faults and the end. ``initdb`` refuses to run as root, so as root both run as the ``postgres``
user (``runuser``), on a folder that user owns. Nothing is pre-provisioned: the binaries are the
Debian package's (``/usr/lib/postgresql/<version>/bin``), or wherever ``BATCHGEN_PG_BIN`` says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import attrs

from tests.live import free_port

#: Where the machine image keeps PostgreSQL's server programs (the newest version wins).
PG_BIN_VARIABLE = "BATCHGEN_PG_BIN"
_DEBIAN_ROOT = Path("/usr/lib/postgresql")


def pg_bin() -> Path:
    """The folder holding ``initdb`` and ``pg_ctl``; FileNotFoundError naming what to install."""
    configured = os.environ.get(PG_BIN_VARIABLE)
    if configured:
        return Path(configured)
    versions = sorted(
        (path for path in _DEBIAN_ROOT.glob("*/bin") if (path / "initdb").exists()),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    if versions:
        return versions[-1]
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise FileNotFoundError(
        f"PostgreSQL's initdb is not in {_DEBIAN_ROOT}/*/bin or on PATH: install the postgresql "
        f"package (apt-get install postgresql), or set {PG_BIN_VARIABLE}"
    )


@attrs.define
class PostgresServer:
    """One running PostgreSQL cluster on 127.0.0.1:``port``."""

    folder: Path
    port: int
    bin: Path
    #: Addresses it listens on besides 127.0.0.1 (a network namespace's way in), trusting all.
    also_listen: tuple[str, ...] = ()
    _databases: int = 0

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    @classmethod
    def start(cls, *, also_listen: tuple[str, ...] = ()) -> PostgresServer:
        folder = Path(tempfile.mkdtemp(prefix="batchgen-postgres-"))
        server = cls(folder, free_port(), pg_bin(), also_listen)
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
        server._run(
            "initdb", "-D", str(server.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"
        )
        if also_listen:
            with (server.data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all samenet trust\n")  # the subnets of those addresses
        server._pg_ctl("start")
        return server

    def url(self, database: str = "postgres", *, host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@{host}:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL (on 127.0.0.1: ``url(name, host=...)`` for another)."""
        self._databases += 1
        name = f"test_{self._databases}"
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` with psql; its output (unaligned, tuples only)."""
        done = subprocess.run(
            [
                str(self.bin / "psql"),
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                self.url(database),
                "-c",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip()

    def restart(self) -> None:
        """``pg_ctl restart -m immediate``: the server dies without a clean shutdown and comes back."""
        self._pg_ctl("restart", "-m", "immediate")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: the server dies without a clean shutdown (``resume``
        starts it again)."""
        self._pg_ctl("stop", "-m", "immediate")

    def resume(self) -> None:
        """Start the server again on the same folder and port, after ``crash``."""
        self._pg_ctl("start")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Fast shutdown (SIGINT to the postmaster, as ``pg_ctl stop -m fast`` sends), waiting for
        it to end. A signal, not a program: this runs at the end of the session, inside whichever
        test ran last, which may be one that must not start processes."""
        pid_file = self.data / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _pg_ctl(self, action: str, *flags: str) -> None:
        listen = ",".join(("127.0.0.1", *self.also_listen))
        options = f"-p {self.port} -c listen_addresses={listen} -k {self.folder} -c fsync=off -c max_connections=200"
        self._run(
            "pg_ctl",
            action,
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            *flags,
            "-o",
            options,
        )

    def _run(self, program: str, *arguments: str) -> None:
        command = [str(self.bin / program), *arguments]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{program} {arguments[0]} failed ({done.returncode}): {done.stderr.strip()}\n{log}"
            )
