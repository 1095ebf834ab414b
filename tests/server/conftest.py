"""Fixtures of the server tests that several modules share."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.replica_fleet import Blobs
from tests.seaweedfs import SeaweedServer


@pytest.fixture(params=["folder", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Blobs:
    """Where a test's replicas keep file contents: a shared folder, then a prefix of its own on the
    real S3 server (SeaweedFS, started on first use)."""
    if request.param == "folder":
        return Blobs(f"file://{tmp_path / 'shared'}")
    seaweed: SeaweedServer = request.getfixturevalue("seaweed_server")
    return Blobs(
        seaweed.url(f"{request.node.module.__name__.rsplit('.', 1)[-1]}-{time.time_ns()}"), seaweed.environ
    )
