"""The ``sglang`` backend inside an embedded BatchService, driving the fake ``sglang`` package.

SGLang cannot be installed on these machines; ``tests/fakes/sglang`` is a stand-in written to
SGLang's documented offline-engine contract (see its docstring). Everything else here is real:
the service, its pools and scheduler, SQLite and the output files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core import (
    BatchParameters,
    BatchService,
    BatchStatus,
    ServiceSettings,
    ServiceUnavailable,
    load_backend,
)
from batchgen.core.backends import BackendUnavailable
from batchgen.core.backends.capabilities import capabilities_of, passed_options
from batchgen.core.backends.sglang_engine import SGLangBackend, rejection_for, sampling_params
from batchgen.core.models import Batch, SamplingParameters
from batchgen.core.requests.schema import read_body, read_envelope
from tests.examples import examples

pytestmark = pytest.mark.anyio

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake ``sglang`` module, importable by the backend, with no engine knobs set.

    It is dropped from ``sys.modules`` afterwards, so no other test sees an ``sglang`` imported.
    """
    monkeypatch.syspath_prepend(str(FAKES))
    for name in (
        "FAKE_SGLANG_DELAY_S",
        "FAKE_SGLANG_DIE_AFTER",
        "FAKE_SGLANG_FAIL_START",
        "FAKE_SGLANG_RECORD",
    ):
        monkeypatch.delenv(name, raising=False)
    import sglang as module

    assert module.__version__.endswith("+fake"), "tests must run against the fake, not a real SGLang"
    module.Engine.instances.clear()
    yield module
    sys.modules.pop("sglang", None)


def _chat(custom_id: str, content: Any, **body: object) -> bytes:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "default", "messages": [{"role": "user", "content": content}], **body},
    }
    return json.dumps(line).encode() + b"\n"


def _completion(custom_id: str, prompt: str, **body: object) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": {"prompt": prompt, **body}}
    return json.dumps(line).encode() + b"\n"


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _run(
    service: BatchService, content: bytes, endpoint: str = CHAT, parameters: BatchParameters | None = None
) -> Batch:
    file = await service.create_file(content)
    batch = await service.create_batch(file.id, endpoint, parameters=parameters)
    with anyio.fail_after(10):
        return await service.wait_for_batch(batch.id)


async def _lines(service: BatchService, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    path, _ = await service.file_content(file_id)
    return {line["custom_id"]: line for line in _read(path)}


def _call_for(engine: Any, text: str) -> Any:
    [call] = [call for call in engine.calls if text in call.prompt_text]
    return call


def _service(tmp_path: Path, backend: Any, **settings: Any) -> BatchService:
    return BatchService(ServiceSettings(storage_path=tmp_path, **settings), backend)


async def test_engine_is_built_from_the_options_and_shut_down(sglang: ModuleType, tmp_path: Path) -> None:
    backend = load_backend(
        "sglang",
        model_path="fake-model",
        tp_size=2,
        dp_size=1,
        mem_fraction_static=None,
        context_length=2048,
        engine_args={"chunked_prefill_size": 8192, "served_model_name": "my-model"},
    )
    assert isinstance(backend, SGLangBackend) and backend.name == "sglang"
    async with _service(tmp_path, backend) as service:
        [engine] = sglang.Engine.instances
        assert engine.kwargs == {
            "model_path": "fake-model",
            "tp_size": 2,
            "dp_size": 1,
            "context_length": 2048,
            "chunked_prefill_size": 8192,
            "served_model_name": "my-model",
        }
        assert service.health().healthy
        assert service.models()[0]["id"] == "my-model"
        assert not engine.shutdown_called
    assert engine.shutdown_called
    assert backend.health().healthy is False


def test_engine_args_may_not_repeat_the_named_options() -> None:
    with pytest.raises(ValueError, match="--tp-size"):
        SGLangBackend(model_path="m", engine_args={"tp_size": 4})


async def test_sampling_parameters_map_to_sglang_names_with_body_over_batch_over_server(
    sglang: ModuleType, tmp_path: Path
) -> None:
    backend = load_backend("sglang", model_path="fake-model")
    async with _service(tmp_path, backend, default_max_tokens=16) as service:
        batch = await _run(
            service,
            _chat("batch-level", "question one")
            + _chat(
                "body",
                "question two",
                max_tokens=3,
                temperature=0.2,
                top_p=0.5,
                top_k=-1,
                seed=11,
                stop=["never", "seen"],
            )
            + _chat("completion-tokens", "question three", max_completion_tokens=2, max_tokens=9),
            parameters=BatchParameters(max_decoding_length=7, temperature=0.5, top_p=0.9, top_k=20),
        )
        assert batch.status is BatchStatus.COMPLETED
        defaults = await _run(service, _chat("server-default", "question four"))
        assert defaults.status is BatchStatus.COMPLETED
        [engine] = sglang.Engine.instances
        assert _call_for(engine, "question one").sampling_params == {
            "max_new_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 20,
        }
        assert _call_for(engine, "question two").sampling_params == {
            "max_new_tokens": 3,
            "temperature": 0.2,
            "top_p": 0.5,
            "sampling_seed": 11,
            "stop": ["never", "seen"],
        }
        assert _call_for(engine, "question three").sampling_params["max_new_tokens"] == 2
        assert _call_for(engine, "question four").sampling_params == {
            "max_new_tokens": 16,
            "temperature": 0.0,
            "top_p": 1.0,
        }
        assert all(call.rid.startswith("req_") for call in engine.calls)


async def test_penalties_reach_the_engine_as_sglangs_same_named_sampling_parameters(
    sglang: ModuleType, tmp_path: Path
) -> None:
    backend = load_backend("sglang", model_path="fake-model")
    async with _service(tmp_path, backend, default_max_tokens=8) as service:
        chats = await _run(
            service,
            _chat("both", "question one", frequency_penalty=0.5, presence_penalty=-1)
            + _chat("bounds", "question two", frequency_penalty=2, presence_penalty=-2.0)
            + _chat("zero", "question three", frequency_penalty=0, presence_penalty=1.25)
            + _chat("none", "question four"),
        )
        completions = await _run(
            service, _completion("completion", "Once upon", frequency_penalty=-0.75), COMPLETIONS
        )
        assert chats.status is completions.status is BatchStatus.COMPLETED
        assert chats.request_counts.completed == 4 and completions.request_counts.completed == 1
        [engine] = sglang.Engine.instances

        def penalties(text: str) -> dict[str, Any]:
            params = _call_for(engine, text).sampling_params
            return {name: value for name, value in params.items() if name.endswith("_penalty")}

        assert penalties("question one") == {"frequency_penalty": 0.5, "presence_penalty": -1.0}
        assert penalties("question two") == {"frequency_penalty": 2.0, "presence_penalty": -2.0}
        assert penalties("question three") == {"presence_penalty": 1.25}  # 0 is SGLang's default
        assert penalties("question four") == {}
        assert penalties("Once upon") == {"frequency_penalty": -0.75}
        assert all(
            type(value) is float for call in engine.calls for value in penalties(call.prompt_text).values()
        )


_penalty_values = st.none() | st.integers(-2, 2) | st.floats(-2, 2, allow_nan=False)


@settings(max_examples=examples(80), deadline=None)
@given(frequency=_penalty_values, presence=_penalty_values, completion=st.booleans())
def test_every_allowed_penalty_is_sent_by_name_and_value(
    frequency: float | None, presence: float | None, completion: bool
) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 4}
    if completion:
        endpoint, body["prompt"] = COMPLETIONS, "Once"
    else:
        endpoint, body["messages"] = CHAT, [{"role": "user", "content": "hi"}]
    for name, value in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if value is not None:
            body[name] = value
    line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}
    parsed = read_body(read_envelope(json.dumps(line).encode()))
    options = passed_options(capabilities_of(SGLangBackend(model_path="m")), endpoint, parsed)
    params = sampling_params(SamplingParameters(max_tokens=4), 4, options)
    sent = {name: value for name, value in params.items() if name.endswith("_penalty")}
    expected = {
        name: float(value)
        for name, value in (("frequency_penalty", frequency), ("presence_penalty", presence))
        if value  # None and 0 ask for nothing and are left to SGLang's default, 0
    }
    assert sent == expected


async def test_finish_reasons_token_counts_and_reasoning_come_back_openai_shaped(
    sglang: ModuleType, tmp_path: Path
) -> None:
    async with _service(tmp_path, load_backend("sglang", model_path="fake-model")) as service:
        batch = await _run(
            service,
            _chat("cut", "tell me a story", max_tokens=2)
            + _chat("natural", "tell me another story", max_tokens=100)
            + _chat("stopped", "and a third one", stop=" ", max_tokens=100)
            + _chat("thinking", "what is 2+2? /think", max_tokens=100),
        )
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
        lines = await _lines(service, batch.output_file_id)
        [engine] = sglang.Engine.instances
        bodies = {custom_id: line["response"]["body"] for custom_id, line in lines.items()}
        finish = {custom_id: body["choices"][0]["finish_reason"] for custom_id, body in bodies.items()}
        assert finish == {"cut": "length", "natural": "stop", "stopped": "stop", "thinking": "stop"}
        for custom_id, content in [
            ("cut", "tell me a story"),
            ("natural", "tell me another story"),
            ("stopped", "and a third one"),
        ]:
            result = _call_for(engine, content).result
            assert bodies[custom_id]["choices"][0]["message"]["content"] == result["text"]
            assert bodies[custom_id]["usage"] == {
                "prompt_tokens": result["meta_info"]["prompt_tokens"],
                "completion_tokens": result["meta_info"]["completion_tokens"],
                "total_tokens": result["meta_info"]["prompt_tokens"]
                + result["meta_info"]["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": result["meta_info"]["cached_tokens"]},
            }
        assert bodies["cut"]["usage"]["completion_tokens"] == 2
        stopped = bodies["stopped"]["choices"][0]["message"]["content"]
        assert stopped and " " not in stopped and bodies["stopped"]["usage"]["completion_tokens"] == 2
        message = bodies["thinking"]["choices"][0]["message"]
        assert (
            message["reasoning_content"] == "the user asks a question so I think about it step by step first"
        )
        assert "think>" not in message["content"] and message["content"]
        assert "reasoning_content" not in bodies["natural"]["choices"][0]["message"]
        assert batch.usage.prompt_tokens == sum(body["usage"]["prompt_tokens"] for body in bodies.values())
        assert batch.usage.completion_tokens == sum(
            body["usage"]["completion_tokens"] for body in bodies.values()
        )


@pytest.mark.parametrize("radix_cache", [True, False])
async def test_the_prompt_tokens_the_radix_cache_served_are_each_lines_cached_tokens(
    sglang: ModuleType, tmp_path: Path, radix_cache: bool
) -> None:
    engine_args = {} if radix_cache else {"disable_radix_cache": True}
    backend = load_backend("sglang", model_path="fake-model", engine_args=engine_args)
    shared = "Answer in one word. " * 10
    async with _service(tmp_path, backend) as service:
        first = await _run(service, _completion("first", shared + "What is red?", max_tokens=3), COMPLETIONS)
        second = await _run(
            service, _completion("second", shared + "What is blue?", max_tokens=3), COMPLETIONS
        )
        [engine] = sglang.Engine.instances
        tokenizer = engine.tokenizer_manager.tokenizer
        [first_line] = (await _lines(service, first.output_file_id)).values()
        [second_line] = (await _lines(service, second.output_file_id)).values()
    served = [
        line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        for line in (first_line, second_line)
    ]
    assert served == [call.result["meta_info"]["cached_tokens"] for call in engine.calls]
    # the second prompt shares the first's tokens up to "What is"
    shared_tokens = len(tokenizer.encode(shared + "What is "))
    assert served == ([0, shared_tokens] if radix_cache else [0, 0])
    assert (first.usage.prefix_cached_tokens, second.usage.prefix_cached_tokens) == tuple(served)


async def test_chat_template_is_applied_and_completions_use_the_raw_prompt(
    sglang: ModuleType, tmp_path: Path
) -> None:
    async with _service(tmp_path, load_backend("sglang", model_path="fake-model")) as service:
        parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]
        chat = await _run(service, _chat("chat", "What is 2+2?") + _chat("parts", parts))
        completion = await _run(service, _completion("plain", "Once upon a time"), endpoint=COMPLETIONS)
        assert chat.status is completion.status is BatchStatus.COMPLETED
        [engine] = sglang.Engine.instances
        tokenizer = engine.tokenizer_manager.tokenizer
        chat_call = _call_for(engine, "What is 2+2?")
        rendered = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        assert chat_call.prompt is None and chat_call.prompt_text == rendered
        assert chat_call.input_ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert (
            "<|im_start|>user\nfirst part\nsecond part<|im_end|>"
            in _call_for(engine, "first part").prompt_text
        )
        plain = _call_for(engine, "Once upon a time")
        assert plain.input_ids == tokenizer.encode("Once upon a time")
        assert "<|im_start|>" not in plain.prompt_text
        [line] = (await _lines(service, completion.output_file_id)).values()
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == plain.result["text"]
        assert body["usage"]["prompt_tokens"] == len(plain.input_ids)


async def test_prompt_longer_than_the_context_is_an_error_line_and_the_output_limit_is_capped(
    sglang: ModuleType, tmp_path: Path
) -> None:
    backend = load_backend("sglang", model_path="fake-model", context_length=64)
    async with _service(tmp_path, backend) as service:
        long_prompt = " ".join(["word"] * 100)
        batch = await _run(
            service,
            _chat("short", "hello there")
            + _chat("long", long_prompt)
            + _chat("tight", " ".join(["w"] * 10), max_tokens=1000),
        )
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
        [engine] = sglang.Engine.instances
        assert engine.kwargs["context_length"] == 64
        tokenizer = engine.tokenizer_manager.tokenizer
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": long_prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_tokens = len(tokenizer.encode(rendered, add_special_tokens=False))
        lines = await _lines(service, batch.output_file_id)  # failed requests' lines are here too
        errors = {custom_id: line for custom_id, line in lines.items() if line["error"] is not None}
        assert set(errors) == {"long"} and errors["long"]["response"] is None
        assert errors["long"]["error"] == {
            "code": "context_length_exceeded",
            "message": f"Prompt length {prompt_tokens} exceeds model context 64",
        }
        assert not [call for call in engine.calls if "word word" in call.prompt_text]  # never sent
        tight = _call_for(engine, "w w w")
        assert tight.sampling_params["max_new_tokens"] == 64 - len(tight.input_ids) - 1
        assert set(lines) - set(errors) == {"short", "tight"}


async def test_a_busy_engine_is_retried_then_written_as_an_error_line(
    sglang: ModuleType, tmp_path: Path
) -> None:
    async with _service(tmp_path, load_backend("sglang", model_path="fake-model")) as service:
        batch = await _run(service, _chat("busy", "[fake:busy] please") + _chat("fine", "hello"))
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        errors = await _lines(service, batch.output_file_id)
        assert errors["fine"]["error"] is None
        assert errors["busy"]["error"]["code"] == "backend_error"
        assert "The request queue is full." in errors["busy"]["error"]["message"]
        [engine] = sglang.Engine.instances
        busy_calls = [call for call in engine.calls if "[fake:busy]" in call.prompt_text]
        assert len(busy_calls) == service.settings.max_request_attempts
        assert len({call.rid for call in busy_calls}) == 1
        assert service.health().healthy


async def test_cancel_aborts_the_requests_in_flight_by_rid(
    sglang: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_DELAY_S", "0.5")  # 4 to 40 tokens: 2 to 20 s a request
    async with _service(tmp_path, load_backend("sglang", model_path="fake-model")) as service:
        file = await service.create_file(
            b"".join(_chat(f"q{i}", f"story {i}", max_tokens=100) for i in range(4))
        )
        batch = await service.create_batch(file.id, CHAT)
        [engine] = sglang.Engine.instances
        with anyio.fail_after(5):
            while len(engine.tokenizer_manager.rid_to_state) < 4:
                await anyio.sleep(0.01)
        started = time.monotonic()
        await service.cancel_batch(batch.id)
        with anyio.fail_after(5):
            batch = await service.wait_for_batch(batch.id, poll_interval=0.01)
        assert time.monotonic() - started < 1.5  # an abort lands at the next token (0.5 s)
        assert batch.status is BatchStatus.CANCELLED
        assert batch.request_counts.completed == 0 and batch.output_file_id is not None
        assert sorted(engine.aborted) == sorted(call.rid for call in engine.calls)
        with anyio.fail_after(2):  # the engine ends each aborted request at its next token
            while engine.tokenizer_manager.rid_to_state:
                await anyio.sleep(0.01)
        assert all(call.aborted for call in engine.calls)
        assert service.health().healthy


async def test_engine_death_fails_running_batches_and_makes_the_service_unhealthy(
    sglang: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_DELAY_S", "0.02")
    monkeypatch.setenv("FAKE_SGLANG_DIE_AFTER", "2")
    async with _service(tmp_path, load_backend("sglang", model_path="fake-model")) as service:
        batch = await _run(service, b"".join(_chat(f"q{i}", f"question {i}") for i in range(6)))
        assert batch.status is BatchStatus.FAILED
        assert batch.error is not None and batch.error.code == "batch_failed"
        assert "the SGLang engine died: FakeEngineDied" in batch.error.message
        health = service.health()
        assert health.healthy is False and health.reason is not None
        assert health.reason.startswith("the SGLang engine died: FakeEngineDied")
        [engine] = sglang.Engine.instances
        calls = len(engine.calls)
        with pytest.raises(ServiceUnavailable, match="the SGLang engine died"):  # 503 while unhealthy
            await _run(service, _chat("later", "anyone there?"))
        assert len(engine.calls) == calls  # a dead engine is not called again
    assert engine.shutdown_called


async def test_a_failing_start_says_why(sglang: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "FAKE_SGLANG_FAIL_START", "Initialization failed. Please see the error messages above."
    )
    backend = SGLangBackend(model_path="/models/missing")
    with pytest.raises(
        BackendUnavailable, match="'/models/missing' could not start: RuntimeError: Initialization"
    ):
        await backend.start()
    health = backend.health()
    assert health.healthy is False and health.reason is not None and "could not start" in health.reason
    monkeypatch.setitem(sys.modules, "sglang", None)  # as if SGLang were not installed
    with pytest.raises(BackendUnavailable, match="sglang package is not installed"):
        await SGLangBackend(model_path="m").start()


def test_importing_and_building_the_backend_does_not_import_sglang() -> None:
    code = (
        "import sys\n"
        "from batchgen.core.backends import load_backend\n"
        "import batchgen.core.backends.sglang_engine\n"
        "load_backend('sglang', model_path='m', engine_args={'log_level': 'info'})\n"
        "assert 'sglang' not in sys.modules, 'sglang was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_sglang_validation_errors_become_request_rejections() -> None:
    too_long = rejection_for(
        "The input (5000 tokens) is longer than the model's context length (4096 tokens)."
    )
    assert (too_long.code, too_long.message) == (
        "context_length_exceeded",
        "Prompt length 5000 exceeds model context 4096",
    )
    total = rejection_for(
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested "
        "a total of 5000 tokens: 1000 tokens from the input messages and 4000 tokens for the completion."
    )
    assert total.code == "context_length_exceeded" and total.message.startswith("Requested token count")
    other = rejection_for("top_p must be in (0, 1], got 2.0.")
    assert (other.code, other.message) == ("invalid_request", "top_p must be in (0, 1], got 2.0.")
