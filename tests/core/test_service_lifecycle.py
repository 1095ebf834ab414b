"""Starting and stopping BatchService: each step undone on failure, no crash hidden.

Start opens the metadata store, starts the backend, starts the scheduler and the maintenance jobs,
then recovers unfinished batches. A failure at any step must undo the steps before it (the
backend stopped, the store closed, every task ended); a background task that crashes is raised
at exit; a maintenance job that keeps failing is reported by ``health`` and recovers by itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from batchgen.core import BatchService, ServiceSettings, load_backend
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.maintenance import Maintenance

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingBackend(SimulatedBackend):
    """The simulated backend, recording start and stop, optionally failing to start."""

    def __init__(self, *, fail_start: bool = False) -> None:
        super().__init__()
        self.events: list[str] = []
        self.fail_start = fail_start

    async def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("no engine today")
        await super().start()

    async def stop(self) -> None:
        self.events.append("stop")
        await super().stop()


async def test_a_backend_that_fails_to_start_leaves_nothing_open(tmp_path: Path) -> None:
    backend = RecordingBackend(fail_start=True)
    service = BatchService(ServiceSettings(storage_path=tmp_path), backend)
    with pytest.raises(RuntimeError, match="no engine today"):
        await service.__aenter__()
    assert backend.events == ["start"]
    assert not service.health().healthy
    with pytest.raises(RuntimeError, match="not started"):
        await service.list_batches()
    async with BatchService(ServiceSettings(storage_path=tmp_path), RecordingBackend()) as again:
        assert again.health().healthy  # the store was closed cleanly and opens again


async def test_a_failing_recovery_undoes_every_earlier_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_recover(*args: object) -> None:
        raise OSError("the disk went away")

    monkeypatch.setattr("batchgen.core.service.recover", broken_recover)
    backend = RecordingBackend()
    service = BatchService(ServiceSettings(storage_path=tmp_path), backend)
    with pytest.raises(OSError, match="the disk went away"):
        await service.__aenter__()
    assert backend.events == ["start", "stop"]
    assert service.scheduler._tasks is None, "the scheduler loop still runs"
    assert not service.health().healthy


async def test_a_crashed_background_task_is_raised_at_exit(tmp_path: Path) -> None:
    async def crash() -> None:
        raise LookupError("a background task broke")

    with pytest.raises(BaseExceptionGroup) as raised:
        async with BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated")) as service:
            service.parts.tasks.start_soon(crash)
            await anyio.sleep(5)  # cancelled by the crash
    assert raised.group_contains(LookupError, match="a background task broke")


async def test_a_failing_maintenance_job_is_reported_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = True

    def sometimes() -> None:
        if broken:
            raise PermissionError("read-only folder")

    service = BatchService(ServiceSettings(storage_path=tmp_path), load_backend("simulated"))
    service.maintenance.add("probe", 0.01, sometimes)
    with caplog.at_level(logging.ERROR, logger="batchgen.service"):
        async with service:
            with anyio.fail_after(5):
                while service.health().healthy:
                    await anyio.sleep(0.01)
            health = service.health()
            assert "probe" in (health.reason or "") and "read-only folder" in (health.reason or "")
            broken = False
            with anyio.fail_after(5):
                while not service.health().healthy:
                    await anyio.sleep(0.01)
    failures = [r for r in caplog.records if "probe" in r.getMessage()]
    assert failures and all(r.exc_info and r.exc_info[0] is PermissionError for r in failures)


async def test_maintenance_counts_failures_in_a_row() -> None:
    outcomes = iter(
        [ValueError("1"), ValueError("2"), None, ValueError("3"), ValueError("4"), ValueError("5")]
    )

    async def job() -> None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    maintenance = Maintenance(unhealthy_after=2)
    maintenance.add("job", 1.0, job)
    seen = []
    for _ in range(6):
        ok = await maintenance.run_once("job")
        seen.append((ok, sorted(maintenance.failing())))
    assert seen == [
        (False, []),
        (False, ["job"]),
        (True, []),
        (False, []),
        (False, ["job"]),
        (False, ["job"]),
    ]
    assert maintenance.failing() == {"job": "ValueError: 5"}
