"""No line stalls the transformers decode loop: grammar compiles and other per-line work are bounded.

With the tiny random-weight model (``tiny_model``; no end-of-sequence token, so an unconstrained
row runs to its own limit). A ``response_format`` schema is checked against its size bounds before
anything compiles it, compiled off the decode loop in a probe process killed at the compile
deadline, and cached by schema; a schema past a bound, too slow, impossible or unsupported is that
line's error line while every other line decodes. Prompts that cannot fit, stop strings and ``n``
cost the loop a bounded amount per line.

Every test here starts the grammar probe process (or a worker), so the module is ``live``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgen.core.backends import RequestAborted
from batchgen.core.backends.hf_decode import ABORTED, REJECTED, DecodeEngine, Outcome
from batchgen.core.backends.hf_grammar_bounds import GrammarBounds
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, GenerationRequest, SamplingParameters
from tests.examples import examples
from tests.tiny_engine import load_tiny_engine, run_to_end

pytestmark = [pytest.mark.model, pytest.mark.live]

#: Small bounds, so that schemas past them are cheap to build and would compile quickly.
SMALL = GrammarBounds(max_schema_bytes=4000, max_properties=30, max_enum_values=30, max_depth=10)
#: Bounds no test schema reaches, for the compile deadline alone.
WIDE = GrammarBounds(max_schema_bytes=10**8, max_properties=10**6, max_enum_values=10**6, max_depth=64)
_ids = itertools.count()


def _engine(model: Path, cache: Path, bounds: GrammarBounds) -> DecodeEngine:
    return load_tiny_engine(model, cache, grammar_bounds=bounds)


@pytest.fixture(scope="module")
def small(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeEngine]:
    engine = _engine(tiny_model, tmp_path_factory.mktemp("cache"), SMALL)
    yield engine
    engine.close()


def _chat(max_tokens: int, options: dict[str, Any] | None = None, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{next(_ids)}",
        endpoint=CHAT_COMPLETIONS,
        sampling=SamplingParameters(max_tokens=max_tokens, **sampling),
        messages=({"role": "user", "content": "Describe a thing."},),
        options=options or {},
    )


def _schema_line(schema: dict[str, Any], max_tokens: int = 30, **options: Any) -> GenerationRequest:
    return _chat(max_tokens, {"response_format": _format(schema), **options})


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def _slow_schema(properties: int = 2000) -> dict[str, Any]:
    """Optional properties make the grammar's compile grow steeply: seconds to minutes."""
    return {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(properties)}}


def _rejected(outcome: Outcome) -> str:
    assert outcome.failure is not None, f"expected an error line, got {outcome.result}"
    assert outcome.failure.kind == REJECTED and outcome.failure.code == "invalid_request"
    assert "response_format" in outcome.failure.message
    return outcome.failure.message


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


#: Schemas past one of SMALL's bounds, of varying sizes.
oversized = st.one_of(
    st.integers(31, 150).map(
        lambda n: {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(n)}}
    ),
    st.integers(31, 400).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
    st.integers(11, 40).map(_nested),
    st.integers(4001, 40000).map(lambda n: {"type": "string", "description": "x" * n}),
)


@settings(
    max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=oversized, choices=st.integers(1, 3))
def test_a_schema_past_a_size_bound_is_its_lines_error_and_the_others_complete(
    small: DecodeEngine, schema: dict[str, Any], choices: int
) -> None:
    compiles = small.grammars.compiles if small.grammars is not None else 0
    big, plain = _schema_line(schema, n=choices), _chat(3)
    outcomes = run_to_end(small, big, plain)
    assert "is too large" in _rejected(outcomes[big.request_id])
    completed = outcomes[plain.request_id].result
    assert completed is not None and completed.completion_tokens == 3
    assert (small.grammars.compiles if small.grammars is not None else 0) == compiles, "never compiled"


@settings(
    max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(properties=st.integers(1, 30), enum=st.integers(1, 30), depth=st.integers(0, 3))
def test_a_schema_within_the_bounds_runs_constrained(
    small: DecodeEngine, properties: int, enum: int, depth: int
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": [f"e{i}" for i in range(enum)]},
            **{f"k{i}": _nested(depth) for i in range(properties - 1)},
        },
        "required": ["kind"],
    }
    line = _schema_line(schema, max_tokens=400)
    outcome = run_to_end(small, line)[line.request_id]
    assert outcome.result is not None, outcome.failure
    assert outcome.result.text.startswith('{"kind": "e')


def _disjoint_types() -> st.SearchStrategy[tuple[str, str]]:
    kinds = ["string", "integer", "boolean", "object", "array", "null"]
    return st.tuples(st.sampled_from(kinds), st.sampled_from(kinds)).filter(lambda pair: pair[0] != pair[1])


@settings(
    max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(types=_disjoint_types(), nested=st.booleans())
def test_an_impossible_schema_is_its_lines_error(
    small: DecodeEngine, types: tuple[str, str], nested: bool
) -> None:
    impossible: dict[str, Any] = {"allOf": [{"type": types[0]}, {"type": types[1]}]}
    if nested:
        impossible = {"type": "object", "properties": {"value": impossible}, "required": ["value"]}
    line, plain = _schema_line(impossible), _chat(2)
    outcomes = run_to_end(small, line, plain)
    assert "never be satisfied" in _rejected(outcomes[line.request_id])
    assert outcomes[plain.request_id].result is not None


@pytest.mark.parametrize(
    "schema",
    [
        {"anyOf": []},  # compiles, but to a grammar no value satisfies
        {"not": {"type": "string"}},  # ignored by the compiler: it would run unconstrained
        {"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {"maxLength": 2}}}},
        {"allOf": [{"type": "object"}, {"required": ["a"]}]},
        {"type": "string", "minLength": 5, "maxLength": 2},
    ],
)
def test_an_unsatisfiable_or_unsupported_schema_never_runs_unconstrained(
    small: DecodeEngine, schema: dict[str, Any]
) -> None:
    line = _schema_line(schema)
    _rejected(run_to_end(small, line)[line.request_id])


def test_a_one_schema_allof_is_that_schema(small: DecodeEngine) -> None:
    # pydantic writes a described $ref as {"allOf": [{"$ref": ...}], "description": ...}
    schema = {
        "$defs": {"Colour": {"enum": ["red", "blue"]}},
        "type": "object",
        "properties": {"colour": {"allOf": [{"$ref": "#/$defs/Colour"}], "description": "a colour"}},
        "required": ["colour"],
    }
    line = _schema_line(schema, max_tokens=40)
    result = run_to_end(small, line)[line.request_id].result
    assert result is not None and json.loads(result.text)["colour"] in {"red", "blue"}


@settings(
    max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(uses=st.lists(st.integers(0, 3), min_size=1, max_size=8), choices=st.integers(1, 2))
def test_each_schema_is_compiled_once_however_many_lines_use_it(
    small: DecodeEngine, uses: list[int], choices: int
) -> None:
    run = next(_ids)  # schemas new to this example (the engine's cache outlives it)
    schemas = [
        {
            "type": "object",
            "title": f"run{run}-{i}",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
        }
        for i in range(4)
    ]
    before = small.grammars.compiles if small.grammars is not None else 0
    lines = [_schema_line(schemas[use], n=choices) for use in uses]
    outcomes = run_to_end(small, *lines)
    assert all(outcomes[line.request_id].result is not None for line in lines)
    assert small.grammars is not None
    assert small.grammars.compiles - before == len(set(uses))


def test_the_grammar_cache_keeps_its_size(tiny_model: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model, tmp_path, GrammarBounds(cache_size=2))
    try:
        schemas = [
            {"type": "object", "title": name, "properties": {"a": {"type": "boolean"}}} for name in "ABC"
        ]
        for schema in [*schemas, schemas[2], schemas[0]]:  # A B C C A: A was dropped when C came
            run_to_end(engine, _schema_line(schema))
        assert engine.grammars.compiles == 4
    finally:
        engine.close()


def test_a_compile_past_its_deadline_is_its_lines_error_and_other_lines_decode_meanwhile(
    tiny_model: Path, tmp_path: Path
) -> None:
    engine = _engine(tiny_model, tmp_path, GrammarBounds(**{**_wide(), "compile_timeout_s": 0.5}))
    try:
        slow = _schema_line(_slow_schema())
        engine.add(slow)
        finished_meanwhile = 0
        plain = _chat(2)
        engine.add(plain)
        outcome = None
        while outcome is None:
            for ended in engine.step():
                if ended.request_id == slow.request_id:
                    outcome = ended
                else:
                    assert ended.result is not None and ended.result.completion_tokens == 2
                    finished_meanwhile += 1
                    plain = _chat(2)
                    engine.add(plain)
        assert "took longer than 0.5 s" in _rejected(outcome)
        assert finished_meanwhile >= 1, "other lines decoded while the schema compiled"
        assert engine.grammars.compiles == 0
        # The same schema again is refused from the cache, without compiling it a second time.
        again = _schema_line(_slow_schema())
        assert "took longer" in _rejected(run_to_end(engine, again, _chat(1))[again.request_id])
    finally:
        engine.close()


def _wide() -> dict[str, Any]:
    return {
        "max_schema_bytes": WIDE.max_schema_bytes,
        "max_properties": WIDE.max_properties,
        "max_enum_values": WIDE.max_enum_values,
        "max_depth": WIDE.max_depth,
    }


def test_an_abort_reaches_a_line_waiting_for_its_grammar(tiny_model: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model, tmp_path, GrammarBounds(**{**_wide(), "compile_timeout_s": 600}))
    try:
        slow = _schema_line(_slow_schema(3000), n=2)
        plain = _chat(3)
        engine.add(slow)
        engine.add(plain)
        outcomes: dict[str, Outcome] = {}
        while plain.request_id not in outcomes:
            outcomes.update({outcome.request_id: outcome for outcome in engine.step()})
        assert slow.request_id not in outcomes, "still waiting for its grammar"
        engine.abort(slow.request_id)
        steps = 0
        while slow.request_id not in outcomes:
            outcomes.update({outcome.request_id: outcome for outcome in engine.step()})
            steps += 1
            assert steps < 100, "the abort did not reach the waiting line"
        failure = outcomes[slow.request_id].failure
        assert failure is not None and failure.kind == ABORTED
        assert not engine.busy
    finally:
        engine.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_backend_aborts_a_line_waiting_for_its_grammar_while_othersrun_to_end(
    tiny_model: Path, tmp_path: Path
) -> None:
    backend = TransformersBackend(
        model=str(tiny_model), cache_dir=tmp_path, max_batch_size=4, grammar_compile_timeout_s=600, **_flags()
    )
    await backend.start()
    try:
        slow = _schema_line(_slow_schema(3000))
        outcome: dict[str, BaseException] = {}

        async def run_slow() -> None:
            try:
                await backend.generate(slow)
            except Exception as exc:  # what came back is checked below
                outcome["error"] = exc

        with anyio.fail_after(120):  # a hang guard only: the compile alone takes minutes
            async with anyio.create_task_group() as group:
                group.start_soon(run_slow)
                for _ in range(3):  # others run while the slow line waits for its grammar
                    result = await backend.generate(_chat(4))
                    assert result.completion_tokens == 4
                assert "error" not in outcome
                await backend.abort(slow.request_id)
        assert isinstance(outcome["error"], RequestAborted)
        assert backend.health().healthy
    finally:
        await backend.stop()


def _flags() -> dict[str, Any]:
    return {f"grammar_{name}": value for name, value in _wide().items()}


@contextlib.contextmanager
def _counting(engine: DecodeEngine) -> Iterator[list[tuple[str, int]]]:
    """Wrap the engine's tokenizer meanwhile: the list gets the size of every text it tokenizes
    (characters), every message list it renders (messages) and every token list it decodes."""
    sizes: list[tuple[str, int]] = []
    tokenizer = engine._tokenizer

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            sizes.append(("tokenize", len(text)))
            return tokenizer(text, **kwargs)

        def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
            sizes.append(("render", len(messages)))
            return tokenizer.apply_chat_template(messages, **kwargs)

        def decode(self, tokens: list[int], **kwargs: Any) -> Any:
            sizes.append(("decode", len(tokens)))
            return tokenizer.decode(tokens, **kwargs)

    engine._tokenizer = Counting()
    try:
        yield sizes
    finally:
        engine._tokenizer = tokenizer


@settings(
    max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=st.integers(1, 40), kind=st.sampled_from(["prompt", "content", "messages"]))
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_rendered_or_tokenized(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, size: int, kind: str
) -> None:
    engine = _engine(tiny_model, tmp_path_factory.mktemp("cache"), SMALL)
    try:
        room = engine.context_length * engine._max_token_chars
        if kind == "prompt":
            request = GenerationRequest(
                request_id="big",
                endpoint=COMPLETIONS,
                sampling=SamplingParameters(max_tokens=2),
                prompt="ab" * (room // 2 + size * 1000),
            )
        else:
            count = engine.context_length + size if kind == "messages" else 3
            content = "" if kind == "messages" else "x" * (room // 3 + size * 1000)
            messages = tuple({"role": "user", "content": content} for _ in range(count))
            request = GenerationRequest(
                request_id="big",
                endpoint=CHAT_COMPLETIONS,
                sampling=SamplingParameters(max_tokens=2),
                messages=messages,
            )
        with _counting(engine) as sizes:
            outcome = run_to_end(engine, request)["big"]
        assert outcome.failure is not None and outcome.failure.code == "context_length_exceeded"
        assert sizes == [], "nothing was rendered or tokenized"
    finally:
        engine.close()


def test_stop_strings_cost_each_step_only_the_tail_and_still_cut_where_they_occur(
    small: DecodeEngine,
) -> None:
    free = _chat(120)
    text = run_to_end(small, free)[free.request_id].result
    assert text is not None
    with _counting(small) as sizes:
        # A stop that never occurs: no step decodes the whole answer.
        never = _chat(120, stop=("\x00never\x00",))
        result = run_to_end(small, never)[never.request_id].result
        assert result is not None and result.text == text.text and result.finish_reason == "length"
        assert sum(kind == "decode" and size > 40 for kind, size in sizes) <= 2, (
            sizes
        )  # the answer, decoded once or twice
    # Stops that do occur cut exactly where the unconstrained answer first holds one.
    for start, length in ((3, 4), (len(text.text) // 2, 6), (len(text.text) - 5, 5)):
        stop = text.text[start : start + length]
        cut = _chat(120, stop=(stop,))
        ended = run_to_end(small, cut)[cut.request_id].result
        assert ended is not None and ended.finish_reason == "stop"
        assert ended.text == text.text[: text.text.find(stop)]
        assert ended.completion_tokens <= 120


@pytest.mark.parametrize("choices", [9, 64, 128])
def test_more_choices_than_the_backend_takes_is_the_lines_error(small: DecodeEngine, choices: int) -> None:
    line = _chat(2, {"n": choices})
    failure = run_to_end(small, line)[line.request_id].failure
    assert failure is not None and failure.kind == REJECTED and "'body.n'" in failure.message
