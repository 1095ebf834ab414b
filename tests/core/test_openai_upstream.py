"""The ``openai`` backend without a network: its pure policies, and the backend over httpx.MockTransport.

The policies (AIMD limit, up/down, where an attempt goes) are tested as plain objects. The backend
is driven through ``transport=httpx.MockTransport(handler)``, where each fake upstream can answer,
fail with a status, refuse connections or hang. The same backend against real upstream servers is
in ``tests/server/test_openai_upstream_server.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends import BackendUnavailable, RequestAborted, RequestRejected, load_backend
from batchgen.core.backends.openai_upstream import (
    OpenAIUpstreamBackend,
    build_body,
    context_rejection,
    error_message,
    normalize_base_url,
    without_stop_sequence,
)
from batchgen.core.backends.upstream_concurrency import (
    AdaptiveLimit,
    UpstreamHealth,
    UpstreamState,
    choose_upstream,
    free_slots,
)
from batchgen.core.models import GenerationRequest, GenerationResult, SamplingParameters

CHAT = "/v1/chat/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- AdaptiveLimit ------------------------------------------------------------------------------
def _saturate(limit: AdaptiveLimit, successes: int) -> None:
    for _ in range(successes):
        limit.on_success(limit.ticket(in_flight=limit.limit))


def test_limit_starts_low_and_doubles_per_saturated_window_until_the_first_overload() -> None:
    limit = AdaptiveLimit(maximum=64, initial=4)
    assert limit.limit == 4
    _saturate(limit, 3)
    assert limit.limit == 4  # a window is `limit` successes
    _saturate(limit, 1)
    assert limit.limit == 8
    _saturate(limit, 8)
    assert limit.limit == 16
    assert limit.on_overload(limit.ticket(in_flight=16))
    assert limit.limit == 8
    _saturate(limit, 8)
    assert limit.limit == 9  # after an overload: one more per window (additive increase)
    _saturate(limit, 9)
    assert limit.limit == 10


def test_limit_grows_only_while_every_slot_is_used() -> None:
    limit = AdaptiveLimit(maximum=64, initial=4)
    for _ in range(100):
        limit.on_success(limit.ticket(in_flight=2))
    assert limit.limit == 4


def test_a_burst_of_failures_from_one_window_halves_once() -> None:
    limit = AdaptiveLimit(maximum=64, initial=32)
    tickets = [limit.ticket(in_flight=n) for n in range(1, 33)]
    assert [limit.on_overload(ticket) for ticket in tickets].count(True) == 1
    assert limit.limit == 16
    assert limit.on_overload(limit.ticket(in_flight=16))  # sent after the cut: halves again
    assert limit.limit == 8


def test_limit_stays_between_minimum_and_maximum() -> None:
    limit = AdaptiveLimit(maximum=6, initial=10)
    assert limit.limit == 6
    _saturate(limit, 100)
    assert limit.limit == 6
    for _ in range(10):
        limit.on_overload(limit.ticket(in_flight=limit.limit))
    assert limit.limit == 1
    limit.reset()
    assert (limit.limit, limit.slow_start) == (6, True)
    with pytest.raises(ValueError):
        AdaptiveLimit(maximum=0)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 80)), max_size=300), st.integers(1, 64))
def test_limit_invariants_under_any_outcomes(outcomes: list[tuple[bool, int]], maximum: int) -> None:
    limit = AdaptiveLimit(maximum=maximum, initial=4)
    for success, in_flight in outcomes:
        before = limit.limit
        ticket = limit.ticket(in_flight)
        if success:
            limit.on_success(ticket)
            assert before <= limit.limit <= max(before * 2, before + 1)
        else:
            limit.on_overload(ticket)
            assert limit.limit in (before, max(1, before // 2))
        assert 1 <= limit.limit <= maximum


# --- UpstreamHealth -----------------------------------------------------------------------------
def test_down_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    health = UpstreamHealth(failures_to_mark_down=3, probe_interval_s=1.0, max_probe_interval_s=4.0)
    assert not health.on_failure("a", now=0.0)
    assert not health.on_failure("b", now=0.0)
    health.on_success()
    assert not health.on_failure("c", now=0.0)
    assert not health.on_failure("d", now=0.0)
    assert health.on_failure("e", now=10.0)
    assert health.down and health.last_error == "e"
    assert not health.on_failure("f", now=10.0)  # already down: reported once
    assert not health.probe_due(10.5) and health.probe_due(11.0)


def test_probes_back_off_while_failing_and_a_good_probe_brings_the_upstream_back() -> None:
    health = UpstreamHealth(probe_interval_s=1.0, max_probe_interval_s=4.0)
    health.mark_down("refused", now=0.0)
    assert health.next_probe_at == 1.0
    health.on_probe_failure("refused", now=1.0)
    assert health.next_probe_at == 3.0
    health.on_probe_failure("refused", now=3.0)
    assert health.next_probe_at == 7.0
    health.on_probe_failure("refused", now=7.0)
    assert health.next_probe_at == 11.0  # capped at max_probe_interval_s
    health.on_probe_success()
    assert not health.down and not health.probe_due(100.0)


# --- choose_upstream ----------------------------------------------------------------------------
def _state(url: str, limit: int, in_flight: int = 0, down: bool = False) -> UpstreamState:
    state = UpstreamState(url, AdaptiveLimit(maximum=limit, initial=limit), UpstreamHealth(), in_flight)
    state.health.down = down
    return state


def test_choose_least_loaded_relative_to_limit() -> None:
    upstreams = [_state("a", 4, in_flight=2), _state("b", 16, in_flight=4), _state("c", 8, in_flight=8)]
    assert choose_upstream(upstreams) == 1  # 4/16 < 2/4; c is full
    assert free_slots(upstreams) == 2 + 12


def test_choose_skips_down_upstreams_and_waits_when_all_are_full() -> None:
    upstreams = [_state("a", 4, down=True), _state("b", 2, in_flight=2)]
    assert choose_upstream(upstreams) is None
    assert free_slots(upstreams) == 0
    upstreams[1].in_flight = 1
    assert choose_upstream(upstreams) == 1


def test_choose_prefers_upstreams_the_request_tried_least() -> None:
    upstreams = [_state("a", 4), _state("b", 4, in_flight=3), _state("c", 4)]
    assert choose_upstream(upstreams, tried={0: 1}) == 2
    assert choose_upstream(upstreams, tried={0: 1, 2: 1}) == 1
    assert choose_upstream(upstreams, tried={0: 2, 1: 1, 2: 2}) == 1
    upstreams[1].in_flight = 4
    assert choose_upstream(upstreams, tried={0: 1, 2: 1}) == 0  # b is full: retry where there is room


# --- pure helpers -------------------------------------------------------------------------------
def test_base_urls() -> None:
    assert normalize_base_url("http://10.0.0.5:30000/v1/") == "http://10.0.0.5:30000/v1"
    assert normalize_base_url("http://10.0.0.5:30000") == "http://10.0.0.5:30000/v1"
    assert normalize_base_url("https://router.example/api/v1") == "https://router.example/api/v1"
    with pytest.raises(ValueError, match="http"):
        normalize_base_url("10.0.0.5:30000")
    with pytest.raises(ValueError, match="twice"):
        OpenAIUpstreamBackend(upstreams=["http://a/v1", "http://a/v1/"])
    with pytest.raises(ValueError, match="at least one"):
        OpenAIUpstreamBackend(upstreams=[])


def _request(
    request_id: str = "req_1", endpoint: str = CHAT, content: str = "What is 2+2?", **sampling: Any
) -> GenerationRequest:
    params = SamplingParameters(**{"max_tokens": 8, **sampling})
    if endpoint == CHAT:
        return GenerationRequest(
            request_id, endpoint, params, messages=({"role": "user", "content": content},)
        )
    return GenerationRequest(request_id, endpoint, params, prompt=content)


def test_request_body_sends_only_what_is_set() -> None:
    body = build_body(_request(), "m")
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    body = build_body(
        _request(endpoint="/v1/completions", content="Once", top_k=20, seed=7, stop=("\n",), temperature=0.7),
        "m",
    )
    assert body == {
        "model": "m",
        "prompt": "Once",
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 20,
        "seed": 7,
        "stop": ["\n"],
    }


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (  # vLLM
            {
                "error": {
                    "message": "This model's maximum context length is 2048 tokens. However, your request "
                    "has 3001 input tokens. Please reduce the length of the input messages.",
                    "type": "BadRequestError",
                    "code": 400,
                }
            },
            "Prompt length 3001 exceeds model context 2048",
        ),
        (  # vLLM, older wording
            {
                "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 "
                "tokens (4990 in the messages, 10 in the completion). Please reduce the length."
            },
            "Prompt length 4990 exceeds model context 4096",
        ),
        (  # OpenAI
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens. However, your messages "
                    "resulted in 9000 tokens. Please reduce the length of the messages.",
                    "code": "context_length_exceeded",
                }
            },
            "Prompt length 9000 exceeds model context 8192",
        ),
        (  # SGLang
            {
                "object": "error",
                "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
            },
            "Prompt length 5000 exceeds model context 4096",
        ),
        (  # SGLang, chat
            {
                "message": "Requested token count exceeds the model's maximum context length of 4096 tokens. "
                "You requested a total of 5010 tokens: 5000 tokens from the input messages and 10 tokens "
                "for the completion."
            },
            "Prompt length 5000 exceeds model context 4096",
        ),
        (  # llama.cpp
            {
                "error": {
                    "code": 400,
                    "message": "request (4476 tokens) exceeds the available context size (4096 tokens), try "
                    "increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 4476,
                    "n_ctx": 4096,
                }
            },
            "Prompt length 4476 exceeds model context 4096",
        ),
        (  # the prompt fits, prompt + max_tokens does not: said as the upstream said it
            {
                "error": {
                    "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's "
                    "maximum context length is 4096 tokens and your request has 2778 input tokens "
                    "(8000 > 4096 - 2778)."
                }
            },
            "'max_tokens' or 'max_completion_tokens' is too large: 8000.",
        ),
    ],
)
def test_context_errors_of_known_servers(payload: dict[str, Any], expected: str) -> None:
    rejection = context_rejection(payload, error_message(payload, ""))
    assert rejection is not None
    assert rejection.code == "context_length_exceeded"
    assert rejection.message.startswith(expected)


def test_a_stop_sequence_left_in_the_text_is_cut_off() -> None:
    ended = GenerationResult(" Paris.", "stop", 5, 2)
    assert without_stop_sequence(ended, (".",)).text == " Paris"
    assert without_stop_sequence(ended, ("\n",)).text == " Paris."
    overran = GenerationResult(" Paris. It is in France.", "stop", 5, 8)  # cut at the first one
    assert without_stop_sequence(overran, ("France", ".")).text == " Paris"
    cut = GenerationResult(" Paris.", "length", 5, 2)  # ran out of tokens: the text is as generated
    assert without_stop_sequence(cut, (".",)).text == " Paris."


def test_other_client_errors_are_not_context_errors() -> None:
    assert context_rejection({"detail": "Unexpected fields in the request: {'top_k'}"}, "Unexpected") is None


# --- the backend over fake upstreams ------------------------------------------------------------
class FakeUpstream:
    """One upstream behind MockTransport: answers like an OpenAI server unless told otherwise."""

    def __init__(self, model: str = "fake-model", latency_s: float = 0.0) -> None:
        self.model = model
        self.latency_s = latency_s
        self.mode = "ok"  # ok | refuse | drop | hang | status
        self.status = 503
        self.error_body: dict[str, Any] = {"error": {"message": "busy"}}
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.answer: dict[str, Any] | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.mode == "refuse":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.method == "GET":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.mode == "hang":
                await anyio.sleep_forever()
            await anyio.sleep(self.latency_s)
            if self.mode in ("drop", "refuse"):  # the server went away while working on it
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request
                )
            if self.mode == "status":
                return httpx.Response(self.status, json=self.error_body)
        finally:
            self.in_flight -= 1
        if self.answer is not None:
            return httpx.Response(200, json=self.answer)
        if "messages" in body:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "It is 4."}}
        else:
            choice = {"index": 0, "text": " Paris."}
        choice["finish_reason"] = "stop"
        usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
        return httpx.Response(200, json={"id": "x", "choices": [choice], "usage": usage, "model": self.model})


class FakeFleet:
    def __init__(self, count: int, **options: Any) -> None:
        self.upstreams = {f"http://up{i}:8000": FakeUpstream(**options) for i in range(count)}

    @property
    def urls(self) -> list[str]:
        return [f"{base}/v1" for base in self.upstreams]

    def __getitem__(self, index: int) -> FakeUpstream:
        return list(self.upstreams.values())[index]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        return await self.upstreams[f"{request.url.scheme}://{request.url.netloc.decode()}"].handle(request)

    def backend(self, **options: Any) -> OpenAIUpstreamBackend:
        settings = {"retry_backoff_s": 0.001, "probe_interval_s": 0.05, **options}
        return OpenAIUpstreamBackend(
            upstreams=self.urls, transport=httpx.MockTransport(self.handle), **settings
        )


@pytest.mark.anyio
async def test_chat_and_completion_results_and_model_from_the_first_upstream() -> None:
    fleet = FakeFleet(2)
    fleet[0].model = "served-model"
    fleet[0].answer = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 30, "completion_tokens": 8},
    }
    backend = fleet.backend(initial_concurrency=1)
    await backend.start()
    try:
        assert backend.model_name == "served-model"
        assert backend.health().healthy
        result = await backend.generate(_request())
        assert (result.text, result.reasoning_content, result.finish_reason) == ("4", "2 and 2", "length")
        assert (result.prompt_tokens, result.completion_tokens) == (30, 8)
        fleet[0].answer = None
        result = await backend.generate(
            _request(endpoint="/v1/completions", content="The capital of France is")
        )
        assert (result.text, result.finish_reason, result.prompt_tokens) == (" Paris.", "stop", 11)
        sent = fleet[0].bodies + fleet[1].bodies
        assert {body["model"] for body in sent} == {"served-model"}
    finally:
        await backend.stop()
    assert not backend.health().healthy


@pytest.mark.anyio
async def test_a_given_model_name_and_api_key_are_sent() -> None:
    seen: list[httpx.Request] = []
    fleet = FakeFleet(1)

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return await fleet.handle(request)

    backend = OpenAIUpstreamBackend(
        upstreams=fleet.urls, model="my-model", api_key="sk-1", transport=httpx.MockTransport(handler)
    )
    await backend.start()
    try:
        await backend.generate(_request())
    finally:
        await backend.stop()
    assert backend.model_name == "my-model"
    assert fleet[0].bodies[0]["model"] == "my-model"
    assert {r.headers["authorization"] for r in seen} == {"Bearer sk-1"}
    assert str(seen[-1].url) == "http://up0:8000/v1/chat/completions"


@pytest.mark.anyio
async def test_requests_spread_over_upstreams_within_each_limit_and_the_limit_grows() -> None:
    fleet = FakeFleet(2, latency_s=0.005)
    backend = fleet.backend(initial_concurrency=2, max_concurrency=6)
    await backend.start()
    try:
        async with anyio.create_task_group() as tasks:
            for i in range(200):
                tasks.start_soon(backend.generate, _request(f"r{i}"))
        assert len(fleet[0].bodies) + len(fleet[1].bodies) == 200
        assert len(fleet[0].bodies) > 50 and len(fleet[1].bodies) > 50
        assert fleet[0].max_in_flight <= 6 and fleet[1].max_in_flight <= 6
        assert [u.limit.limit for u in backend.upstreams] == [6, 6]
        assert all(u.in_flight == 0 for u in backend.upstreams)
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_429_halves_the_limit_and_the_request_is_retried_on_another_upstream() -> None:
    fleet = FakeFleet(2)
    fleet[0].mode, fleet[0].status = "status", 429
    backend = fleet.backend(initial_concurrency=8)
    await backend.start()
    try:
        results = []
        for i in range(6):
            results.append(await backend.generate(_request(f"r{i}")))
        assert all(result.text == "It is 4." for result in results)
        assert backend.upstreams[0].limit.limit < 8
        assert not backend.upstreams[0].health.down  # busy, not broken
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_a_dead_upstream_is_marked_down_its_requests_go_elsewhere_and_it_comes_back() -> None:
    fleet = FakeFleet(2, latency_s=0.01)
    backend = fleet.backend(initial_concurrency=4)
    await backend.start()
    try:
        fleet[0].mode = "drop"  # in-flight requests lose their connection ...
        async with anyio.create_task_group() as tasks:
            for i in range(8):
                tasks.start_soon(backend.generate, _request(f"a{i}"))
            await anyio.sleep(0.005)
            fleet[0].mode = "refuse"  # ... and new connections are refused
        assert backend.upstreams[0].health.down
        assert "Connection refused" in (backend.upstreams[0].health.last_error or "") or "disconnected" in (
            backend.upstreams[0].health.last_error or ""
        )
        assert backend.health().healthy  # the other one serves
        before = len(fleet[1].bodies)
        await backend.generate(_request("b"))
        assert len(fleet[1].bodies) == before + 1
        fleet[0].mode = "ok"
        with anyio.fail_after(5):
            while backend.upstreams[0].health.down:
                await anyio.sleep(0.02)
        assert backend.upstreams[0].limit.limit == 4  # starts again from the initial limit
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_every_upstream_down_is_backend_unavailable_and_unhealthy_with_the_reason() -> None:
    fleet = FakeFleet(2)
    backend = fleet.backend()
    await backend.start()
    try:
        fleet[0].mode = fleet[1].mode = "refuse"
        with pytest.raises(BackendUnavailable) as caught:
            for i in range(10):
                await backend.generate(_request(f"r{i}"))
        health = backend.health()
        assert not health.healthy
        for reason in (str(caught.value), health.reason or ""):
            assert "http://up0:8000/v1" in reason and "http://up1:8000/v1" in reason
            assert "Connection refused" in reason
        with pytest.raises(BackendUnavailable):
            await backend.generate(_request("after"))
        fleet[1].mode = "ok"
        with anyio.fail_after(5):
            while not backend.health().healthy:
                await anyio.sleep(0.02)
        assert (await backend.generate(_request("again"))).text == "It is 4."
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_starting_with_no_upstream_reachable_is_unhealthy_not_an_error() -> None:
    fleet = FakeFleet(1)
    fleet[0].mode = "refuse"
    backend = fleet.backend()
    await backend.start()
    try:
        assert not backend.health().healthy
        assert backend.model_name == ""
        fleet[0].mode = "ok"
        with anyio.fail_after(5):
            while not backend.health().healthy:
                await anyio.sleep(0.02)
        assert backend.model_name == "fake-model"
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_transient_failures_are_retried_a_bounded_number_of_times_then_an_error() -> None:
    fleet = FakeFleet(2)
    fleet[0].mode = fleet[1].mode = "status"
    fleet[0].error_body = fleet[1].error_body = {"error": {"message": "engine overloaded"}}
    backend = fleet.backend(max_attempts=3, failures_to_mark_down=100)
    await backend.start()
    try:
        with pytest.raises(RequestRejected) as caught:
            await backend.generate(_request())
    finally:
        await backend.stop()
    assert caught.value.code == "upstream_error"
    assert caught.value.message.count("HTTP 503: engine overloaded") == 3
    assert "http://up0:8000/v1" in caught.value.message and "http://up1:8000/v1" in caught.value.message
    assert len(fleet[0].bodies) + len(fleet[1].bodies) == 3


@pytest.mark.anyio
async def test_context_too_long_is_rejected_at_once_and_other_client_errors_too() -> None:
    fleet = FakeFleet(2)
    for upstream in (fleet[0], fleet[1]):
        upstream.mode, upstream.status = "status", 400
        upstream.error_body = {
            "object": "error",
            "message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        }
    backend = fleet.backend()
    await backend.start()
    try:
        with pytest.raises(RequestRejected) as caught:
            await backend.generate(_request())
        assert (caught.value.code, caught.value.message) == (
            "context_length_exceeded",
            "Prompt length 9000 exceeds model context 8192",
        )
        assert len(fleet[0].bodies) + len(fleet[1].bodies) == 1  # no retry
        fleet[0].status = fleet[1].status = 422
        fleet[0].error_body = fleet[1].error_body = {"detail": "Unexpected fields in the request: {'top_k'}"}
        with pytest.raises(RequestRejected) as caught:
            await backend.generate(_request(top_k=5))
        assert caught.value.code == "invalid_request"
        assert "HTTP 422" in caught.value.message and "top_k" in caught.value.message
        assert backend.health().healthy
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_context_length_option_checks_the_prompt_tokens_the_upstream_reports() -> None:
    fleet = FakeFleet(1)
    backend = fleet.backend(context_length=10)  # the fake reports 11 prompt tokens
    await backend.start()
    try:
        with pytest.raises(RequestRejected) as caught:
            await backend.generate(_request())
    finally:
        await backend.stop()
    assert (caught.value.code, caught.value.message) == (
        "context_length_exceeded",
        "Prompt length 11 exceeds model context 10",
    )


@pytest.mark.anyio
async def test_abort_cancels_the_http_call() -> None:
    fleet = FakeFleet(1)
    backend = fleet.backend()
    await backend.start()
    try:
        fleet[0].mode = "hang"
        outcome: list[BaseException] = []

        async def run() -> None:
            try:
                await backend.generate(_request("slow"))
            except RequestAborted as exc:
                outcome.append(exc)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run)
                while fleet[0].in_flight == 0:
                    await anyio.sleep(0.005)
                await backend.abort("slow")
        assert len(outcome) == 1
        assert fleet[0].in_flight == 0 and backend.upstreams[0].in_flight == 0
        await backend.abort("unknown")  # nothing to abort: no error
    finally:
        await backend.stop()


@pytest.mark.anyio
async def test_a_request_waiting_for_a_slot_can_be_aborted() -> None:
    fleet = FakeFleet(1)
    backend = fleet.backend(initial_concurrency=1, max_concurrency=1)
    await backend.start()
    try:
        fleet[0].mode = "hang"
        aborted: list[str] = []

        async def run(request_id: str) -> None:
            try:
                await backend.generate(_request(request_id))
            except RequestAborted:
                aborted.append(request_id)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run, "first")
                tasks.start_soon(run, "second")
                while fleet[0].in_flight == 0 or not backend._waiters:
                    await anyio.sleep(0.005)
                await backend.abort("second")  # waiting for the only slot
                await anyio.sleep(0.01)
                assert aborted == ["second"] and fleet[0].in_flight == 1
                await backend.abort("first")
        assert aborted == ["second", "first"]
    finally:
        await backend.stop()


# --- through BatchService -----------------------------------------------------------------------
def _lines(count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": CHAT,
                "body": {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.anyio
async def test_batch_completes_exactly_once_when_an_upstream_dies_mid_batch(tmp_path: Path) -> None:
    fleet = FakeFleet(2, latency_s=0.005)
    backend = fleet.backend()
    async with BatchService(ServiceSettings(storage_path=tmp_path), backend) as service:
        file = await service.create_file(_lines(100))
        batch = await service.create_batch(file.id, CHAT)
        with anyio.fail_after(20):
            while (await service.get_batch(batch.id)).request_counts.completed < 20:
                await anyio.sleep(0.005)
        fleet[0].mode = "drop"
        batch = await service.wait_for_batch(batch.id)
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (100, 0)
        path, _ = await service.file_content(batch.output_file_id or "")
        assert sorted(line["custom_id"] for line in _read(path)) == sorted(f"q{i}" for i in range(100))
        assert service.health().healthy


@pytest.mark.anyio
async def test_batch_fails_with_batch_failed_when_every_upstream_is_down(tmp_path: Path) -> None:
    fleet = FakeFleet(2, latency_s=0.005)
    backend = load_backend(
        "openai",
        upstreams=fleet.urls,
        max_concurrency=4,
        transport=httpx.MockTransport(fleet.handle),
        retry_backoff_s=0.001,
    )
    async with BatchService(ServiceSettings(storage_path=tmp_path), backend) as service:
        file = await service.create_file(_lines(200))
        batch = await service.create_batch(file.id, CHAT)
        with anyio.fail_after(20):
            while (await service.get_batch(batch.id)).request_counts.completed < 10:
                await anyio.sleep(0.005)
        fleet[0].mode = fleet[1].mode = "refuse"
        with anyio.fail_after(20):
            batch = await service.wait_for_batch(batch.id)
        assert batch.status is BatchStatus.FAILED
        assert batch.error is not None and batch.error.code == "batch_failed"
        assert "http://up0:8000/v1" in batch.error.message and "http://up1:8000/v1" in batch.error.message
        health = service.health()
        assert not health.healthy and "every upstream server is down" in (health.reason or "")
        path, _ = await service.file_content(batch.output_file_id or "")
        assert len(_read(path)) == batch.request_counts.completed >= 10
