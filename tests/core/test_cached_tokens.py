"""The prompt tokens an engine's prefix cache served (``cached_tokens``): bounded where a backend
parses them, written on every output line the OpenAI way, replayed lines saying all their prompt,
and read back from the result files as recovery does.

Hypothesis feeds the openai backend's parser every shape of upstream ``usage`` (the field missing,
null, a string, a float, a bool, negative, beyond the prompt, nested wrongly) and the replay
rewrite every body the line builder makes. One test runs a batch through a real BatchService on
the openai backend, over upstreams behind httpx's MockTransport that report cache hits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core import BatchService, BatchStatus, ServiceSettings
from batchgen.core.backends.cached_tokens import bounded_cached_tokens, upstream_cached_tokens
from batchgen.core.backends.openai_upstream import _MalformedResponse, parse_result
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES, GenerationResult
from batchgen.core.requests.results import line_cached_tokens, output_line, replayed_body, response_body_json
from batchgen.core.requests.schema import read_body, read_envelope
from batchgen.core.storage.result_files import read_finished_lines
from tests.core.test_openai_upstream import FakeFleet

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
#: ``cached_tokens`` values an upstream might send, sane or not.
_cached_values = (
    st.integers(-(2**70), 2**70)
    | st.integers(0, 64)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=True)
    | st.text(max_size=6)
    | _json_values
)
_details = st.none() | _json_values | st.fixed_dictionaries({}, optional={"cached_tokens": _cached_values})
_usage = st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 64), "completion_tokens": st.integers(0, 64)},
    optional={"prompt_tokens_details": _details},
)


def _chat_answer(usage: object) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}
    return {"choices": [choice], "usage": usage}


# --- parsing, bounded ---------------------------------------------------------------------------
@given(value=_cached_values, prompt_tokens=st.integers(0, 64))
def test_only_an_int_within_the_prompt_is_kept(value: object, prompt_tokens: int) -> None:
    kept = bounded_cached_tokens(value, prompt_tokens)
    valid = type(value) is int and 0 <= value <= prompt_tokens  # a bool is no count
    assert kept == (value if valid else None)


@given(usage=_usage | _json_values)
def test_any_upstream_usage_gives_none_or_a_count_within_the_prompt(usage: Any) -> None:
    try:
        result = parse_result(CHAT_COMPLETIONS, _chat_answer(usage))
    except _MalformedResponse:  # a usage that is no object, or counts that are no numbers...
        without = (
            {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
            if isinstance(usage, dict)
            else usage
        )
        with pytest.raises(_MalformedResponse):  # ...never its cached_tokens alone
            parse_result(CHAT_COMPLETIONS, _chat_answer(without))
        return
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    sent = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(sent) is int and 0 <= sent <= result.prompt_tokens:
        assert result.cached_tokens == sent
    else:
        assert result.cached_tokens is None
    assert 0 <= result.reported_cached_tokens <= result.prompt_tokens


def test_what_known_servers_send_is_read() -> None:
    vllm = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    openai = {**vllm, "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0}}
    no_details = {"prompt_tokens": 40, "completion_tokens": 2}  # transformers serve; vLLM by default
    null_details = {**no_details, "prompt_tokens_details": None}  # vLLM's UsageInfo left unset
    assert parse_result(CHAT_COMPLETIONS, _chat_answer(vllm)).cached_tokens == 32
    assert parse_result(CHAT_COMPLETIONS, _chat_answer(openai)).cached_tokens == 0
    assert parse_result(CHAT_COMPLETIONS, _chat_answer(no_details)).cached_tokens is None
    assert parse_result(CHAT_COMPLETIONS, _chat_answer(null_details)).cached_tokens is None
    completion = {"choices": [{"index": 0, "text": " Paris.", "finish_reason": "stop"}], "usage": vllm}
    assert parse_result(COMPLETIONS, completion).cached_tokens == 32
    assert upstream_cached_tokens({**vllm, "prompt_tokens_details": {"cached_tokens": 41}}, 40) is None


@given(cached=st.none() | st.integers(-5, 80), prompt_tokens=st.integers(0, 64))
def test_a_line_reports_what_the_engine_said_or_zero(cached: int | None, prompt_tokens: int) -> None:
    result = GenerationResult("x", "stop", prompt_tokens, 1, cached_tokens=cached)
    expected = cached if cached is not None and 0 <= cached <= prompt_tokens else 0
    assert result.reported_cached_tokens == expected
    assert line_cached_tokens(CHAT_COMPLETIONS, result) == expected
    assert line_cached_tokens(EMBEDDINGS, result) == 0  # an embeddings line has no such field


# --- the lines ----------------------------------------------------------------------------------
def _body(endpoint: str, fields: dict[str, Any]) -> Any:
    line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": {"model": "m", **fields}}
    return read_body(read_envelope(json.dumps(line).encode()))


_BODIES: dict[str, dict[str, Any]] = {
    CHAT_COMPLETIONS: {"messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"prompt": "hi"},
    RESPONSES: {"input": "hi"},
}


def _usage_of(endpoint: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) a body's usage says."""
    usage = body["usage"]
    if endpoint == RESPONSES:
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("endpoint", sorted(_BODIES))
@pytest.mark.parametrize("cached", [None, 0, 7, 12, 13])
def test_every_line_says_what_the_engine_served_and_zero_when_it_does_not_say(
    endpoint: str, cached: int | None
) -> None:
    result = GenerationResult("an answer", "stop", 12, 3, cached_tokens=cached)
    line = json.loads(output_line("a", "req_1", endpoint, "m", result, 1, _body(endpoint, _BODIES[endpoint])))
    expected = cached if cached is not None and cached <= 12 else 0
    assert _usage_of(endpoint, line["response"]["body"]) == (12, expected)


_texts = st.text(st.characters(codec="utf-8"), max_size=30)  # quotes, escapes, line breaks
_results = st.builds(
    GenerationResult,
    text=_texts,
    finish_reason=st.sampled_from(["stop", "length"]),
    prompt_tokens=st.integers(0, 10_000),
    completion_tokens=st.integers(0, 10_000),
    reasoning_content=st.none() | _texts,
    cached_tokens=st.none() | st.integers(0, 10_000),
)


@given(endpoint=st.sampled_from(sorted(_BODIES)), result=_results)
def test_a_replayed_body_is_the_first_with_all_its_prompt_cached(
    endpoint: str, result: GenerationResult
) -> None:
    first = response_body_json(endpoint, "m", result, 1, _body(endpoint, _BODIES[endpoint]))
    replayed = replayed_body(endpoint, first, result.prompt_tokens)
    decoded, original = msgspec.json.decode(replayed), msgspec.json.decode(first)
    assert _usage_of(endpoint, decoded) == (result.prompt_tokens, result.prompt_tokens)
    details = "input_tokens_details" if endpoint == RESPONSES else "prompt_tokens_details"
    original["usage"][details]["cached_tokens"] = result.prompt_tokens
    assert decoded == original  # nothing else changed
    assert list(decoded["usage"]) == list(original["usage"])  # nor moved
    assert b"\n" not in replayed and replayed_body(endpoint, replayed, result.prompt_tokens) == replayed


def test_an_entry_stored_before_cached_tokens_were_written_gains_them_on_replay() -> None:
    old = (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"4","refusal":null},"logprobs":null,'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
    )
    replayed = msgspec.json.decode(replayed_body(CHAT_COMPLETIONS, old, 9))
    assert replayed["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 9},
    }
    embeddings = b'{"object":"list","data":[],"model":"m","usage":{"prompt_tokens":3,"total_tokens":3}}'
    assert replayed_body(EMBEDDINGS, embeddings, 3) == embeddings


# --- what recovery reads back --------------------------------------------------------------------
def test_recovery_counts_the_engines_hits_of_computed_lines_only(tmp_path: Path) -> None:
    chat = GenerationResult("a", "stop", 20, 2, cached_tokens=16)
    lines = [
        output_line(
            "c1", "r1", CHAT_COMPLETIONS, "m", chat, 1, _body(CHAT_COMPLETIONS, _BODIES[CHAT_COMPLETIONS])
        ),
        output_line(
            "r1",
            "r2",
            RESPONSES,
            "m",
            GenerationResult("b", "stop", 30, 4, cached_tokens=8),
            1,
            _body(RESPONSES, _BODIES[RESPONSES]),
        ),
        output_line(
            "n1",
            "r3",
            COMPLETIONS,
            "m",
            GenerationResult("c", "stop", 5, 1),
            1,
            _body(COMPLETIONS, _BODIES[COMPLETIONS]),
        ),
    ]
    replay = json.loads(lines[0])
    replay["custom_id"], replay["cached"] = "c2", True
    replay["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] = 20
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"".join(lines) + json.dumps(replay).encode() + b"\n" + b'{"custom_id": "torn", "resp')
    finished = read_finished_lines(path)
    assert finished.custom_ids == ["c1", "r1", "n1", "c2"]
    assert finished.prefix_cached_tokens == 16 + 8  # the replayed line's are the result cache's
    assert (finished.cached, finished.cached_prompt_tokens) == (1, 20)
    # a /v1/responses line counts its input and output tokens too
    assert (finished.prompt_tokens, finished.completion_tokens) == (20 + 30 + 5 + 20, 2 + 4 + 1 + 2)


# --- through BatchService on the openai backend ------------------------------------------------
def _chat_lines(count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": CHAT_COMPLETIONS,
                "body": {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_upstream_hits_reach_the_lines_the_batch_and_the_counters(tmp_path: Path) -> None:
    fleet = FakeFleet(2)
    answer = _chat_answer(
        {"prompt_tokens": 11, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
    )
    fleet[0].answer = answer
    fleet[1].answer = {**answer, "usage": {"prompt_tokens": 11, "completion_tokens": 3}}  # says nothing
    async with BatchService(ServiceSettings(storage_path=tmp_path), fleet.backend()) as service:
        file = await service.create_file(_chat_lines(40))
        batch = await service.create_batch(file.id, CHAT_COMPLETIONS)
        with anyio.fail_after(20):
            batch = await service.wait_for_batch(batch.id)
        assert batch.status is BatchStatus.COMPLETED
        path, _ = await service.file_content(batch.output_file_id or "")
        lines = [json.loads(raw) for raw in path.read_text().splitlines()]
        counts = [
            line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in lines
        ]
        assert set(counts) <= {0, 8} and len(counts) == 40
        assert len(fleet[0].bodies) == counts.count(8) and len(fleet[1].bodies) == counts.count(0)
        assert batch.usage.prefix_cached_tokens == sum(counts) == service.telemetry.prefix_cached_tokens
        assert batch.to_dict()["usage"]["input_tokens_details"]["cached_tokens"] == sum(counts)
