"""Prefix-grouped admission in the intake pool: fairness untouched, every line once, prefixes together.

``PrefixGroupingMachine`` runs the same operations on two real ``IntakePool``s: one whose batches'
indexes carry prefix keys (``LineIndex.prefixes``, a few keys per batch, lines of a key scattered
over the batch), one whose indexes carry none, so it admits lines in the order they were queued,
as before prefixes existed. Batches come from three tenants of random weights, with random
deadlines (so deadline turns and fair turns happen), some queued as an explicit subset of their
lines in a random order (as a restart queues the lines with no result yet), some through a
reservation, some cancelled; admissions are sometimes restricted to an admissible subset of the
batches (the scheduler's model shares). It states:

1. Turns unchanged: every admission goes to the same batch (and so the same tenant) in both pools,
   and ``pop`` gives None in both or neither; queued counts agree batch by batch.
2. Exactly once: each queued line of a batch is admitted at most once, only if it was queued, and
   once the pools are drained every line queued was admitted or dropped by a cancel.
3. Prefixes together: among a batch's own admissions, the lines of one key come out as one run,
   the runs in the order of each key's first line among the lines queued, each run in queued order
   (``prefix_groups``); the pool without keys admits each batch's lines in queued order.

``test_a_restart_regroups_the_remaining_lines_and_runs_each_once`` runs a real service over the
simulated backend: a batch of shuffled prefixes is interrupted half way (the service leaves), and
the next service runs the rest, each line exactly once, its remaining lines again grouped.
"""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import IntakeFull
from batchgen.core.files.batch_file import LineIndex
from batchgen.core.models import GenerationRequest, GenerationResult
from batchgen.core.requests.prefix_keys import prefix_key
from batchgen.core.scheduling import IntakePool
from tests.core.test_scheduling_state_machines import make_index
from tests.examples import examples

TENANTS = ("t0", "t1", "t2")


def _expected_order(queued: list[int], keys: array) -> list[int]:
    """The lines of each key together, keys in order of first appearance in ``queued``."""
    runs: dict[int, list[int]] = {}
    for line in queued:
        runs.setdefault(keys[line], []).append(line)
    return [line for run in runs.values() for line in run]


class PrefixGroupingMachine(RuleBasedStateMachine):
    """A pool with prefix keys against one without, under the same operations."""

    @initialize(weights=st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 3.0])] * len(TENANTS)))
    def setup(self, weights: tuple[float, ...]) -> None:
        self.grouped = IntakePool(400)
        self.plain = IntakePool(400)
        for pool in (self.grouped, self.plain):
            for tenant, weight in zip(TENANTS, weights, strict=True):
                pool.set_weight(tenant, weight)
        self.count = 0
        self.indexes: dict[str, tuple[LineIndex, LineIndex]] = {}
        self.expected: dict[str, list[int]] = {}  # the admission order each batch must follow
        self.plain_expected: dict[str, list[int]] = {}
        self.admitted: dict[str, list[int]] = {}
        self.plain_admitted: dict[str, list[int]] = {}
        self.dropped: dict[str, set[int]] = {}
        self.reserved: dict[str, tuple[str, int]] = {}

    def _indexes(self, size: int, keys: list[int]) -> tuple[LineIndex, LineIndex]:
        plain = make_index(self.count * 100_000, [10 + (line * 7) % 13 for line in range(size)])
        return LineIndex(plain.offsets, plain.lengths, array("q", keys)), plain

    def _queue(
        self,
        batch_id: str,
        tenant: str | None,
        keys: list[int],
        lines: list[int] | None,
        deadline: float | None,
    ) -> None:
        grouped_index, plain_index = self._indexes(len(keys), keys)
        wanted = list(range(len(keys))) if lines is None else lines
        outcomes: list[int | None] = []
        for pool, index in ((self.grouped, grouped_index), (self.plain, plain_index)):
            try:
                outcomes.append(pool.add(batch_id, index, lines, tenant=tenant, deadline=deadline))
            except IntakeFull:
                outcomes.append(None)
        assert outcomes[0] == outcomes[1], "one pool refused what the other took"
        if outcomes[0] is None:
            return
        assert outcomes[0] == len(wanted)
        self.indexes[batch_id] = (grouped_index, plain_index)
        self.expected[batch_id] = _expected_order(wanted, grouped_index.prefixes)  # type: ignore[arg-type]
        self.plain_expected[batch_id] = list(wanted)
        self.admitted[batch_id] = []
        self.plain_admitted[batch_id] = []
        self.dropped[batch_id] = set()

    @rule(
        tenant=st.sampled_from(TENANTS),
        keys=st.lists(st.integers(0, 4), min_size=1, max_size=30),
        deadline=st.one_of(st.none(), st.sampled_from([100.0, 200.0, 300.0])),
        data=st.data(),
    )
    def add_batch(self, tenant: str, keys: list[int], deadline: float | None, data: st.DataObject) -> None:
        batch_id = f"b{self.count}"
        self.count += 1
        lines = None
        if data.draw(st.booleans(), label="a resumed subset"):
            lines = data.draw(st.lists(st.integers(0, len(keys) - 1), unique=True), label="lines")
        self._queue(batch_id, tenant, keys, lines, deadline)

    @rule(tenant=st.sampled_from(TENANTS), size=st.integers(1, 20))
    def reserve(self, tenant: str, size: int) -> None:
        batch_id = f"b{self.count}"
        self.count += 1
        refused = 0
        for pool in (self.grouped, self.plain):
            try:
                pool.reserve(batch_id, size, tenant)
            except IntakeFull:
                refused += 1
        assert refused in (0, 2)
        if not refused:
            self.reserved[batch_id] = (tenant, size)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def convert(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.reserved)), label="converted")
        _, size = self.reserved.pop(batch_id)
        keys = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size), label="keys")
        self._queue(batch_id, None, keys, None, None)  # the tenant its reservation was made for

    @precondition(lambda self: self.indexes)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.indexes)), label="cancelled")
        dropped = self.grouped.drop(batch_id)
        assert dropped == self.plain.drop(batch_id)
        ended = set(self.admitted[batch_id]) | self.dropped[batch_id]
        left = [line for line in self.expected[batch_id] if line not in ended]
        assert dropped == len(left)
        self.dropped[batch_id].update(left)

    @rule(count=st.integers(1, 40), data=st.data())
    def admit(self, count: int, data: st.DataObject) -> None:
        allowed: set[str] | None = None
        restricted: bool = data.draw(st.booleans(), label="restricted")
        if restricted and self.indexes:
            allowed = set(
                data.draw(st.lists(st.sampled_from(sorted(self.indexes)), unique=True), label="allowed")
            )
        for _ in range(count):
            admissible = None if allowed is None else allowed.__contains__
            entry = self.grouped.pop(admissible)
            other = self.plain.pop(admissible)
            assert (entry is None) == (other is None), "one pool had nothing to admit, the other had"
            if entry is None or other is None:
                return
            assert entry.batch_id == other.batch_id, "prefix grouping changed whose turn it was"
            self._check(entry.batch_id, entry.line, entry.offset, entry.length)
            self.plain_admitted[other.batch_id].append(other.line)

    def _check(self, batch_id: str, line: int, offset: int, length: int) -> None:
        index = self.indexes[batch_id][0]
        assert (offset, length) == (index.offsets[line], index.lengths[line])
        admitted = self.admitted[batch_id]
        assert line not in admitted, f"{batch_id} line {line} admitted twice"
        assert line not in self.dropped[batch_id]
        admitted.append(line)

    @invariant()
    def same_queues(self) -> None:
        assert self.grouped.size == self.plain.size
        assert self.grouped.free == self.plain.free
        for batch_id in self.indexes:
            assert self.grouped.queued(batch_id) == self.plain.queued(batch_id)

    @invariant()
    def prefixes_come_out_together(self) -> None:
        for batch_id, admitted in self.admitted.items():
            assert admitted == self.expected[batch_id][: len(admitted)], (
                f"{batch_id} admitted {admitted}, not in its prefix-grouped order {self.expected[batch_id]}"
            )
            keys = self.indexes[batch_id][0].prefixes
            assert keys is not None
            runs = [
                keys[line]
                for position, line in enumerate(admitted)
                if not position or keys[admitted[position - 1]] != keys[line]
            ]
            assert len(runs) == len(set(runs)), f"{batch_id}: a key's lines came out in two runs"
            plain = self.plain_admitted[batch_id]
            assert plain == self.plain_expected[batch_id][: len(plain)], "the pool without keys reordered"

    def teardown(self) -> None:
        if not hasattr(self, "grouped"):
            return
        while True:
            entry, other = self.grouped.pop(), self.plain.pop()
            assert (entry is None) == (other is None)
            if entry is None or other is None:
                break
            assert entry.batch_id == other.batch_id
            self._check(entry.batch_id, entry.line, entry.offset, entry.length)
        for batch_id, order in self.expected.items():
            done = set(self.admitted[batch_id])
            assert done | self.dropped[batch_id] == set(order), f"{batch_id}: a queued line never ended"
            assert not done & self.dropped[batch_id]


PrefixGroupingMachine.TestCase.settings = settings(
    max_examples=examples(80), stateful_step_count=40, deadline=None
)
TestPrefixGroupingMachine = PrefixGroupingMachine.TestCase


# -- across a restart, with the real service ---------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Recording(SimulatedBackend):
    """The simulated backend, one request at a time (``capacity=1``: each through ``generate``),
    recording the prefix key and the item of every request it is given, in order; with
    ``hold_after``, the request after that many never ends (the service leaves meanwhile)."""

    def __init__(self, hold_after: int | None = None) -> None:
        super().__init__(capacity=1)
        self.keys: list[int | None] = []
        self.ids: list[str] = []
        self.hold_after = hold_after
        self.held = anyio.Event()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.hold_after is not None and len(self.keys) >= self.hold_after:
            self.held.set()
            await anyio.sleep_forever()
        assert request.messages is not None
        self.keys.append(prefix_key(request.model, messages=request.messages))
        self.ids.append(str(request.messages[-1]["content"]))
        return await super().generate(request)


def _runs(keys: list[int | None]) -> int:
    return sum(1 for position, key in enumerate(keys) if not position or keys[position - 1] != key)


@pytest.mark.anyio
async def test_a_restart_regroups_the_remaining_lines_and_runs_each_once(tmp_path: Path) -> None:
    rng = random.Random(3)
    lines: list[dict[str, Any]] = []
    for prefix in range(6):
        system = f"Prefix {prefix}. " + "shared instructions " * 40
        for item in range(8):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"p{prefix}-i{item}"},
            ]
            lines.append(
                {
                    "custom_id": f"p{prefix}-i{item}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "default", "messages": messages},
                }
            )
    rng.shuffle(lines)
    path = tmp_path / "input.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    settings_ = ServiceSettings(storage_path=tmp_path / "storage", max_pool_size=1, shutdown_grace_s=0.05)

    first = _Recording(hold_after=20)
    async with BatchService(settings_, first) as service:
        file = await service.create_file(path)
        batch = await service.create_batch(file.id, "/v1/chat/completions")
        with anyio.fail_after(30):
            await first.held.wait()
    assert len(first.ids) == 20 and _runs(first.keys) <= 3, "the first 20 admissions were not grouped"

    second = _Recording()
    async with BatchService(settings_, second) as service:
        with anyio.fail_after(30):
            while (await service.get_batch(batch.id)).status is not BatchStatus.COMPLETED:
                await anyio.sleep(0.01)
    assert sorted(first.ids + second.ids) == sorted(line["custom_id"] for line in lines), (
        "a line ran twice or never"
    )
    assert _runs(second.keys) == len(set(second.keys)), "the remaining lines of a prefix did not run together"
