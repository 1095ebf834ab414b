"""The transformers backend's worker process and its decode loop, with the tiny random-weight model.

- the model runs in a separate process; killing it mid-batch loses no request and answers none
  twice, and stopping the backend leaves no process behind;
- continuous batching: a finished row's place is taken by a waiting request at the next step,
  and a request gets the same tokens whether it runs alone or joins a running batch;
- ``dtype`` is chosen from what the CPU supports, or set.

The tiny model (``tiny_model`` in tests/conftest.py) has no end-of-sequence token, so every row
runs to its own limit unless aborted.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import anyio
import pytest

from batchgen.core.backends import BackendUnavailable, hf_worker
from batchgen.core.backends.hf_decode import DecodeEngine, Outcome
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.models import CHAT_COMPLETIONS, GenerationRequest, GenerationResult, SamplingParameters
from tests.tiny_engine import load_tiny_engine

pytestmark = [pytest.mark.anyio, pytest.mark.model, pytest.mark.live]  # live: it starts a worker process


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _request(
    request_id: str, max_tokens: int, content: str = "Hello there", **sampling: object
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        messages=({"role": "user", "content": content},),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_the_model_runs_in_another_process_and_stop_leaves_none(
    tiny_model: Path, tmp_path: Path
) -> None:
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path)
    await backend.start()
    pid = backend.worker_pid
    assert pid is not None and pid != os.getpid() and _alive(pid)
    assert "batchgen.core.backends.hf_worker" in Path(f"/proc/{pid}/cmdline").read_text()
    result = await backend.generate(_request("one", max_tokens=4))
    assert result.completion_tokens == 4
    assert backend.health().healthy
    await backend.stop()
    assert not _alive(pid), "the worker process is gone (and reaped) once stop returns"
    assert not backend.health().healthy
    with pytest.raises(BackendUnavailable):
        await backend.generate(_request("late", max_tokens=4))


async def test_a_worker_killed_mid_batch_is_replaced_and_every_request_answers_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path, max_batch_size=4)
    await backend.start()
    first_pid = backend.worker_pid
    assert first_pid is not None
    results: dict[str, list[GenerationResult]] = {}
    try:

        async def run(n: int) -> None:
            result = await backend.generate(_request(f"r{n}", max_tokens=150 + n, content=f"Prompt {n}"))
            results.setdefault(f"r{n}", []).append(result)

        async def kill_once_running() -> None:
            while not results:  # the first rows have finished: the worker is mid-batch
                await anyio.sleep(0.01)
            os.kill(first_pid, signal.SIGKILL)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(kill_once_running)
            for n in range(10):
                tasks.start_soon(run, n)
        assert backend.worker_restarts == 1
        assert backend.worker_pid not in (None, first_pid)
        assert not _alive(first_pid)
        assert backend.health().healthy
    finally:
        replacement = backend.worker_pid
        await backend.stop()
    assert {name: [r.completion_tokens for r in answers] for name, answers in results.items()} == {
        f"r{n}": [150 + n] for n in range(10)
    }
    assert replacement is not None and not _alive(replacement)


async def test_many_requests_share_the_worker_and_each_keeps_its_own_sampling(
    tiny_model: Path, tmp_path: Path
) -> None:
    backend = TransformersBackend(model=str(tiny_model), cache_dir=tmp_path, max_batch_size=3)
    await backend.start()
    results: dict[str, GenerationResult] = {}
    try:

        async def run(name: str, request: GenerationRequest) -> None:
            results[name] = await backend.generate(request)

        async with anyio.create_task_group() as tasks:
            for n in range(4):
                tasks.start_soon(run, f"greedy{n}", _request(f"greedy{n}", max_tokens=6 + n))
            for name in ("seed-a", "seed-b"):
                request = _request(name, max_tokens=8, content="Write a word.", temperature=1.0, seed=7)
                tasks.start_soon(run, name, request)
            tasks.start_soon(run, "top", _request("top", max_tokens=5, temperature=0.7, top_p=0.5, top_k=3))
        alone = await backend.generate(
            _request("seed-c", max_tokens=8, content="Write a word.", temperature=1.0, seed=7)
        )
    finally:
        await backend.stop()
    assert [results[f"greedy{n}"].completion_tokens for n in range(4)] == [6, 7, 8, 9]
    assert results["seed-a"].text == results["seed-b"].text == alone.text, "a seed decides the text"
    assert results["top"].completion_tokens == 5


def _run_until_done(engine: DecodeEngine) -> tuple[list[list[str]], dict[str, Outcome]]:
    """Step until idle: the ids that ended at each step, and every outcome."""
    ended: list[list[str]] = []
    outcomes: dict[str, Outcome] = {}
    while engine.busy:
        finished = engine.step()
        ended.append([outcome.request_id for outcome in finished])
        outcomes.update({outcome.request_id: outcome for outcome in finished})
    return ended, outcomes


def test_a_finished_row_is_replaced_at_the_next_step(tiny_model: Path, tmp_path: Path) -> None:
    engine = load_tiny_engine(tiny_model, tmp_path, max_batch_size=2)
    engine.add(_request("short", max_tokens=2))
    engine.add(_request("long", max_tokens=12))
    engine.add(_request("waiting", max_tokens=3))
    ended, outcomes = _run_until_done(engine)
    order = [request_id for step in ended for request_id in step]
    # In a padded batch "waiting" would start after "long" ended; here it takes "short"'s place.
    assert order == ["short", "waiting", "long"]
    step_of = {request_id: index for index, step in enumerate(ended) for request_id in step}
    assert step_of["waiting"] - step_of["short"] == 3, "admitted (and its first token chosen) the step after"
    assert {
        name: outcome.result.completion_tokens for name, outcome in outcomes.items() if outcome.result
    } == {
        "short": 2,
        "long": 12,
        "waiting": 3,
    }


def test_a_request_gets_the_same_tokens_alone_and_joining_a_running_batch(
    tiny_model: Path, tmp_path: Path
) -> None:
    probe = _request("probe", max_tokens=10, content="A rather longer prompt that pads the others")
    seeded = _request("seeded", max_tokens=10, content="Roll the dice", temperature=1.0, seed=3)
    alone = load_tiny_engine(tiny_model, tmp_path, max_batch_size=8)
    alone.add(probe)
    alone.add(seeded)
    _, by_itself = _run_until_done(alone)
    crowded = load_tiny_engine(tiny_model, tmp_path, max_batch_size=8)
    for n in range(3):
        crowded.add(_request(f"early{n}", max_tokens=20, content=f"Early {n}"))
    crowded.step()
    crowded.step()  # the early rows are mid-way when the probe and the seeded row join them
    crowded.add(probe)
    crowded.add(seeded)
    _, joined = _run_until_done(crowded)
    for name in ("probe", "seeded"):
        assert joined[name].result == by_itself[name].result, name


def test_stop_strings_abort_and_context_end_rows_early(tiny_model: Path, tmp_path: Path) -> None:
    engine = load_tiny_engine(tiny_model, tmp_path, max_batch_size=4)
    engine.add(_request("free", max_tokens=30))
    free = _run_until_done(engine)[1]["free"].result
    assert free is not None and len(free.text) > 6
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 2]
    engine.add(_request("stopped", max_tokens=30, stop=(stop,)))
    engine.add(_request("aborted", max_tokens=30))
    # The stop string may already be in the first step's token (a long token on some CPUs), so
    # the outcomes of that step count too.
    first_step = {outcome.request_id: outcome for outcome in engine.step()}
    engine.abort("aborted")
    _, outcomes = _run_until_done(engine)
    outcomes = first_step | outcomes
    stopped = outcomes["stopped"].result
    assert stopped is not None and stopped.finish_reason == "stop" and stop not in stopped.text
    assert stopped.completion_tokens < 30
    aborted = outcomes["aborted"].failure
    assert aborted is not None and aborted.kind == "aborted"
    engine.add(_request("huge", max_tokens=5, content="word " * 5000))
    _, outcomes = _run_until_done(engine)
    failure = outcomes["huge"].failure
    assert failure is not None and failure.code == "context_length_exceeded"


def test_long_prompts_join_over_several_steps(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.core.backends import hf_decode

    engine = load_tiny_engine(tiny_model, tmp_path, max_batch_size=8)
    prompt_tokens = len(engine._prompt_ids(_request("probe", max_tokens=1))[0])
    monkeypatch.setattr(hf_decode, "PREFILL_TOKENS", 2 * prompt_tokens)  # two such prompts per step
    for n in range(5):
        engine.add(_request(f"r{n}", max_tokens=6))
    running = []
    while engine.busy:
        engine.step()
        running.append(engine.running)
    assert running[:3] == [2, 4, 5]
    assert running[-1] == 0


def _worker_pipe(model: Path, cache: Path) -> tuple[Connection, Connection, hf_worker.WorkerOptions]:
    """The backend's end and the worker's end of a socket pair, as the backend makes them, and the
    options of a worker over the tiny model (batches of 2)."""
    ours, theirs = socket.socketpair()
    options = hf_worker.WorkerOptions(
        model=str(model),
        cache_dir=str(cache),
        device="cpu",
        dtype="auto",
        max_batch_size=2,
        context_length=None,
    )
    return Connection(ours.detach()), Connection(theirs.detach()), options


def test_the_worker_protocol_through_a_pipe(tiny_model: Path, tmp_path: Path) -> None:
    """``hf_worker.serve`` on a thread here, spoken to through a socket pair as the backend does."""

    server_end, worker_end, options = _worker_pipe(tiny_model, tmp_path)
    assert options.command(7)[1:5] == ["-m", "batchgen.core.backends.hf_worker", "--fd", "7"]
    assert hf_worker._parse(options.command(7)[3:]) == (7, options)
    worker = threading.Thread(target=hf_worker.serve, args=(worker_end, options))
    worker.start()
    try:
        while (message := server_end.recv())[0] == "heartbeat":  # they come while the model loads
            pass
        kind, info = message
        assert kind == "ready" and info.model_name == tiny_model.name and info.context_length == 4096
        server_end.send(("submit", _request("a", max_tokens=3)))
        server_end.send(("submit", _request("b", max_tokens=500)))
        server_end.send(("submit", _request("c", max_tokens=500)))  # waits: two places
        server_end.send(("abort", "c"))
        ended: dict[str, Outcome] = {}
        while "a" not in ended or "c" not in ended:
            message = server_end.recv()
            if message[0] == "done":
                ended.update({outcome.request_id: outcome for outcome in message[1]})
        assert ended["a"].result is not None and ended["a"].result.completion_tokens == 3
        failure = ended["c"].failure
        assert failure is not None and failure.kind == "aborted"
        server_end.send(("stop",))  # "b" is still running: it ends as the worker stops
        while "b" not in ended:
            message = server_end.recv()
            if message[0] == "done":
                ended.update({outcome.request_id: outcome for outcome in message[1]})
        stopped = ended["b"].failure
        assert stopped is not None and stopped.kind == "transient"
    finally:
        server_end.close()  # a worker whose server is gone stops too
        worker.join(timeout=60)
    assert not worker.is_alive()


def test_the_heartbeat_says_how_long_the_loop_has_been_in_one_turn(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stuck in one step still heartbeats (another thread), but says how long it has been
    stuck, so the backend's health can turn false; a loop waiting for work reports 0."""

    release = threading.Event()
    real_step = DecodeEngine.step

    def stuck_step(self: DecodeEngine) -> list[Outcome]:
        release.wait(60)
        return real_step(self)

    monkeypatch.setattr(DecodeEngine, "step", stuck_step)
    monkeypatch.setattr(hf_worker, "HEARTBEAT_S", 0.2)
    server_end, worker_end, options = _worker_pipe(tiny_model, tmp_path)
    worker = threading.Thread(target=hf_worker.serve, args=(worker_end, options))
    worker.start()
    try:
        while server_end.recv()[0] != "ready":  # heartbeats come while the model loads
            pass
        idle = [server_end.recv() for _ in range(3)]
        assert all(message[0] == "heartbeat" and message[1] < 0.5 for message in idle), idle
        assert idle[-1] == ("heartbeat", 0.0, 0, 0), idle  # idle: no turn, no rows, no tokens yet
        server_end.send(("submit", _request("a", max_tokens=2)))
        turn = 0.0
        while turn < 1.0:  # heartbeats keep coming, each saying the turn has lasted longer
            message = server_end.recv()
            assert message[0] == "heartbeat"
            assert message[1] >= turn
            turn = message[1]
        release.set()
        while (message := server_end.recv())[0] != "done":
            pass
        assert message[1][0].result is not None
    finally:
        release.set()
        server_end.close()
        worker.join(timeout=60)
    assert not worker.is_alive()
