"""API keys for tests: create, revoke and list them with the real ``batchgen-server keys`` command.

Each call starts a process, so tests using these are marked ``live``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx


def keys_command(storage_path: Path, *arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``batchgen-server keys ARGUMENTS --storage-path STORAGE``."""
    command, *rest = arguments
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.server.cli",
            "keys",
            command,
            *rest,
            "--storage-path",
            str(storage_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def create_key(storage_path: Path, tenant: str, *flags: str) -> tuple[str, str]:
    """A new key for ``tenant``: (its id, the key from the last line of the output)."""
    result = keys_command(storage_path, "create", "--tenant", tenant, *flags)
    key = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"bg-[0-9a-f]{12}-[0-9a-f]{64}", key), result.stdout
    return key.split("-")[1], key


def authorized(base_url: str, key: str | None) -> httpx.Client:
    """An httpx client of the server sending ``key`` as a bearer token (none when None)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=base_url, headers=headers, timeout=30)
