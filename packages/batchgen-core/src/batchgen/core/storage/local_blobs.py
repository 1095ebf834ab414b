"""LocalBlobStore: file contents in folders under the storage path (the ``BlobStore`` protocol).

{root}/files/{file_id}.jsonl              uploaded files
{root}/incremental/{batch_id}.jsonl       a batch's output file, appended as requests finish
{root}/incremental/{batch_id}.errors.jsonl  a batch's error file
{root}/staging/                           uploads being received, moved into files/ when valid

Replicas sharing one folder each stage in a folder of their own (``staging_dir``, inside the
shared folder so a valid upload is moved into files/ by a rename): a replica clearing what its
last run left half received never touches another's uploads in progress.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from pathlib import Path

from batchgen.core.storage.result_files import FinishedLines, OutputWriter, read_finished_lines


class LocalBlobStore:
    """Uploads, result files and staged uploads as plain files under ``root``."""

    def __init__(self, root: Path, *, staging_dir: Path | None = None) -> None:
        self.root = root
        self.files_dir = root / "files"
        self.incremental_dir = root / "incremental"
        self.staging_dir = staging_dir or root / "staging"
        for folder in (self.files_dir, self.incremental_dir, self.staging_dir):
            folder.mkdir(parents=True, exist_ok=True)

    def upload_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def output_path(self, batch_id: str) -> Path:
        return self.incremental_dir / f"{batch_id}.jsonl"

    def error_path(self, batch_id: str) -> Path:
        return self.incremental_dir / f"{batch_id}.errors.jsonl"

    def new_staging_path(self) -> Path:
        return self.staging_dir / f"upload-{secrets.token_hex(8)}.part"

    def clear_staging(self) -> None:
        """Remove uploads a previous run left half received."""
        for leftover in self.staging_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()

    def remove(self, path: str | os.PathLike[str]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def publish(self, path: Path) -> None:
        """Nothing to do: a file in place under ``files/`` is where every reader looks."""

    def readable(self, path: str) -> Path:
        return Path(path)

    @staticmethod
    def open_result_writer(path: Path) -> OutputWriter:
        return OutputWriter(path)

    @staticmethod
    def read_finished(path: Path) -> FinishedLines:
        return read_finished_lines(path)


def move_file(source: Path, destination: Path) -> None:
    """Rename ``source`` to ``destination``; when they are on two filesystems, copy it to a
    temporary name beside ``destination`` (synced), rename that, and delete ``source``, so
    ``destination`` is never seen half written."""
    try:
        os.replace(source, destination)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        copy = destination.with_name(f".{destination.name}.{secrets.token_hex(6)}.moving")
        try:
            shutil.copyfile(source, copy)
            with open(copy, "rb") as stream:
                os.fsync(stream.fileno())
            os.replace(copy, destination)
        finally:
            copy.unlink(missing_ok=True)
        source.unlink()
