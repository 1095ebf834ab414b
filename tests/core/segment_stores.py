"""Empty segment stores of both kinds for tests: a folder, or a prefix of a real SeaweedFS bucket.

``new_store`` (in ``tests/core/conftest.py``) is parametrized over the two, so a test that takes
it runs over ``SegmentFiles`` and ``S3Segments`` alike (the S3 one marked ``live``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

from batchgen.core.work.s3_segments import S3Segments
from batchgen.core.work.segment_files import SegmentFiles
from batchgen.core.work.segment_store import SegmentStore
from tests.seaweedfs import SeaweedServer

StoreFactory = Callable[[], SegmentStore]
_fresh = itertools.count()


@pytest.fixture(params=["files", pytest.param("s3", marks=pytest.mark.live)])
def new_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StoreFactory:
    """Makes empty stores of one kind: a folder, or a prefix of a SeaweedFS bucket."""
    if request.param == "files":
        return lambda: SegmentFiles(tmp_path_factory.mktemp("segments"))
    server: SeaweedServer = request.getfixturevalue("seaweed_server")
    return lambda: S3Segments.from_url(server.url(f"test-{time.time_ns()}-{next(_fresh)}"), server.environ)
