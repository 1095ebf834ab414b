"""Validation's fast way (blocks, whole-line decode) decides exactly as its exact way, line by line.

``validate_batch_file`` checks most lines by decoding each whole line with one decoder and checking
the rest on the result, in blocks of whole lines; any line that fails that is checked again the
exact way, which says what is wrong. Hypothesis builds files of valid and broken lines (wrong
fields, other endpoints, duplicates, out-of-range parameters, models not served, bad UTF-8, deep
nesting, huge integers, blank and CRLF lines, a last line without a newline) and checks that the
result, accepted or the problems reported, is the one the exact way alone gives, whatever the
block size, with served model names or with the service's models (a ``ModelSet``, whose
``check_line`` and one-model-per-file rule the fast way must apply too; embeddings and responses
lines, which have no whole-line decoder, go the exact way). Files of one endpoint's lines in a
few shapes, mostly acceptable, check the way that accepts many lines at once (by shape, and
``custom_id`` sets), and a spy checks that it does take them. It also checks the block-wide first
look of the JSON bounds against the per-line one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core.backends.capabilities import Capabilities
from batchgen.core.backends.served_models import ModelSet, ServedModel
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.errors import InvalidBatchFile
from batchgen.core.files import batch_file
from batchgen.core.files.batch_file import LineRouter, validate_batch_file
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from batchgen.core.requests import json_bounds
from tests.examples import examples

CHAT = CHAT_COMPLETIONS
SERVED = ("simulated", "default")


def _model_set() -> ModelSet:
    """Two models: the default serves chat and completions only; "other-model" serves every
    endpoint and feature."""
    everything = SimulatedBackend(model_name="other-model")
    everything.capabilities = Capabilities(
        endpoints=frozenset({CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS}),
        features=frozenset({"response_format", "logprobs", "n", "dimensions"}),
    )
    return ModelSet([ServedModel(SimulatedBackend()), ServedModel(everything)])


def _chat_body(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": draw(st.text(max_size=20))}]}
    if draw(st.booleans()):
        body["model"] = draw(st.sampled_from(["default", "simulated", "other-model"]))
    extra: dict[str, Any] = draw(
        st.sampled_from(
            [
                {},
                {"max_tokens": 5},
                {"max_tokens": 0},
                {"temperature": 3},
                {"top_p": 0.5, "seed": 7},
                {"stop": ["a", "b", "c", "d", "e"]},
                {"stream": True},
                {"n": 2},
                {"prompt": "x"},
                {"messages": []},
                {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                {"messages": "hi"},
                {"metadata": {"x": [1, 2, {"y": None}]}},
                {"logprobs": True, "top_logprobs": 2},
                {"response_format": {"type": "json_object"}},
                {"max_tokens": 0, "temperature": 3, "top_p": 2},  # several problems on one line
                {"stop": "x" * 2000},
                {"logit_bias": {"5": 1}},
                {"logit_bias": {}},
                {"logit_bias": {"a": 500}},
                {"frequency_penalty": 0, "tools": []},
                {"tools": [{"type": "function"}]},
                {"messages": [{"role": "robot", "content": "x"}, {"role": "tool", "content": None}]},
            ]
        )
    )
    body.update(extra)
    return body


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """One line's bytes, without its line ending."""
    kind = draw(st.integers(0, 16))
    custom_id = draw(st.sampled_from(["a", "b", "c", "d", "e", "f", ""]))
    line: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": _chat_body(draw)}
    if kind == 0:
        line["url"] = COMPLETIONS
        line["body"] = {"prompt": draw(st.text(max_size=10))}
    elif kind == 1:
        line["method"] = "GET"
    elif kind == 2:
        del line[draw(st.sampled_from(["custom_id", "method", "url", "body"]))]
    elif kind == 3:
        line["custom_id"] = 5
    elif kind == 4:
        line["body"] = "not an object"
    elif kind == 5:
        return b""  # blank
    elif kind == 6:
        return b"   "
    elif kind == 7:
        return json.dumps(line).encode()[:-3]  # cut short
    elif kind == 8:
        return json.dumps(line).encode().replace(b"POST", b"P\xffST")  # not UTF-8
    elif kind == 9:
        line["body"]["metadata"] = json.loads("[" * 70 + "]" * 70)
    elif kind == 10:
        line["body"]["seed"] = 2**70
    elif kind == 11:
        line["body"]["x"] = 12345678901234567890123
    elif kind == 12:
        return json.dumps([line]).encode()
    elif kind == 13:
        line["url"] = "/v1/embeddings"
        line["body"] = {"input": draw(st.sampled_from(["hi", ["a", "b"], 5])), "model": "other-model"}
    elif kind == 14:
        line["url"] = "/v1/responses"
        line["body"] = {"input": draw(st.sampled_from(["hi", 5])), "max_output_tokens": 4}
    return json.dumps(line, ensure_ascii=draw(st.booleans())).encode()


def _outcome(path: Path, served: tuple[str, ...] | LineRouter) -> object:
    try:
        return validate_batch_file(str(path), served)
    except InvalidBatchFile as exc:
        return ("invalid", [(problem.line, problem.message) for problem in exc.problems], str(exc))


@settings(max_examples=examples(300), deadline=None)
@given(
    content=st.lists(st.tuples(lines(), st.sampled_from([b"\n", b"\r\n"])), min_size=1, max_size=25),
    last_newline=st.booleans(),
    block_bytes=st.sampled_from([16, 200, 1000, 1 << 20]),
    with_models=st.booleans(),
)
def test_the_fast_way_decides_as_the_exact_way(
    tmp_path_factory: pytest.TempPathFactory,
    content: list[tuple[bytes, bytes]],
    last_newline: bool,
    block_bytes: int,
    with_models: bool,
) -> None:
    data = b"".join(line + ending for line, ending in content)
    if not last_newline:
        data = data[: -len(content[-1][1])]
    path = tmp_path_factory.mktemp("validation") / "input.jsonl"
    path.write_bytes(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_file, "VALIDATION_BLOCK_BYTES", block_bytes)
        served = _model_set() if with_models else SERVED
        fast = _outcome(path, served)
        patch.setattr(batch_file, "lines_within_bounds", lambda block: False)  # every line the exact way
        exact = _outcome(path, served)
    assert fast == exact


#: Body fields a line may add to its endpoint's input: each makes another shape (see
#: ``requests.schema.BlockReader``), some of them accepted, some refused by the schema or by a
#: model (the default model has none of the features), some with values equal across types.
_SHAPE_EXTRAS: list[dict[str, Any]] = [
    # accepted on either endpoint by the default model
    {},
    {"max_tokens": 5},
    {"temperature": 1},
    {"temperature": 1.0},
    {"top_p": 0.5, "seed": 7},
    {"stop": "x"},
    {"stream": False},
    {"n": 1},
    {"response_format": None},
    {"metadata": {"x": [1, 2]}},
    {"logprobs": 0},  # a chat line's logprobs is a boolean
    {"logprobs": False},  # a completion line's is an integer
    {"stop": ["x", "y"]},  # a list or an object: the shape cannot be hashed
    {"response_format": {"type": "text"}},
    # refused somewhere: by the schema, by the default model, or by the fast ways
    {"max_tokens": 0},
    {"temperature": 3},
    {"stream": True},
    {"n": 2},
    {"n": True},
    {"logprobs": 2},
    {"logprobs": 6},
    {"logprobs": True, "top_logprobs": 2},
    {"top_logprobs": 2},
    {"stop": ["a", "b", "c", "d", "e"]},
    {"response_format": {"type": "json_object"}},
    {"response_format": 1},
    {"response_format": True},
    {"prompt": None},
    {"prompt": 0},
    {"prompt": False},
    {"messages": None},
]
_MODELS = [None, "default", "simulated", "other-model", "not-served"]
#: What a line may be: mostly unchanged, or broken in one way.
_LINE_KINDS = ["ok"] * 60 + [
    *["duplicate"] * 4,
    "empty custom_id",
    "GET",
    "other endpoint",
    "no input",
    "bad input",
    "text part without text",
    "embeddings",
    "blank",
    "cut short",
    "not UTF-8",
    "CRLF",
]


@st.composite
def shaped_files(draw: st.DrawFn) -> tuple[bytes, str]:
    """A file of one endpoint's lines drawn from a few shapes, mostly acceptable, with now and
    then a duplicate ``custom_id``, a blank or CRLF line, bad UTF-8, a broken line, another
    endpoint's line, a line without its input, and its endpoint."""
    endpoint = draw(st.sampled_from([CHAT, COMPLETIONS]))
    # a base shape, mostly acceptable, and shapes that differ from it in the model or in a field
    model = draw(st.sampled_from(_MODELS[:3]))
    base = draw(st.sampled_from(_SHAPE_EXTRAS[:14]))
    variants = st.one_of(
        st.tuples(st.sampled_from(_MODELS), st.just(base), st.just({})),
        st.tuples(st.just(model), st.just(base), st.sampled_from(_SHAPE_EXTRAS)),
    )
    shapes = [(model, base, {})] * 3 + draw(st.lists(variants, max_size=3))
    # in half the files no shape can be hashed
    every_line = draw(st.sampled_from([{}, {"stop": ["x", "y"]}]))
    ids: list[str] = []
    data = b""
    for number in range(draw(st.integers(1, 80))):
        line_model, extra, more = draw(st.sampled_from(shapes))
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"q{number}"}]}
        if endpoint == COMPLETIONS:
            body = {"prompt": f"q{number}"}
        if line_model is not None:
            body["model"] = line_model
        body.update(every_line)
        body.update(extra)
        body.update(more)
        custom_id = f"id-{number}"
        line: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
        kind = draw(st.sampled_from(_LINE_KINDS))
        if kind == "duplicate" and ids:
            line["custom_id"] = draw(st.sampled_from(ids))
        elif kind == "empty custom_id":
            line["custom_id"] = ""
        elif kind == "GET":
            line["method"] = "GET"
        elif kind == "other endpoint":
            line["url"] = COMPLETIONS if endpoint == CHAT else CHAT
        elif kind == "no input":
            body.pop("messages" if endpoint == CHAT else "prompt")
        elif kind == "bad input":
            body["messages" if endpoint == CHAT else "prompt"] = [] if endpoint == CHAT else 5
        elif kind == "text part without text":
            body["messages"] = [{"role": "user", "content": [{"type": "text"}]}]
        elif kind == "embeddings":
            line["url"] = "/v1/embeddings"
            line["body"] = {"input": "hi", "model": "other-model"}
        ids.append(line["custom_id"])
        raw = json.dumps(line, ensure_ascii=draw(st.booleans())).encode()
        if kind == "blank":
            raw = b""
        elif kind == "cut short":
            raw = raw[:-2]
        elif kind == "not UTF-8":
            raw = raw.replace(b"POST", b"P\xffST")
        data += raw + (b"\r\n" if kind == "CRLF" else b"\n")
    return data, endpoint


@settings(max_examples=examples(500), deadline=None)
@given(
    file=shaped_files(),
    block_bytes=st.sampled_from([300, 3000, 1 << 20]),
    at_once_lines=st.sampled_from([1, 7, 256]),
    max_new_shapes=st.sampled_from([0, 1, 16]),
    with_models=st.booleans(),
)
def test_accepting_lines_at_once_decides_as_the_exact_way(
    tmp_path_factory: pytest.TempPathFactory,
    file: tuple[bytes, str],
    block_bytes: int,
    at_once_lines: int,
    max_new_shapes: int,
    with_models: bool,
) -> None:
    path = tmp_path_factory.mktemp("validation") / "input.jsonl"
    path.write_bytes(file[0])
    served = _model_set() if with_models else SERVED
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_file, "VALIDATION_BLOCK_BYTES", block_bytes)
        patch.setattr(batch_file, "AT_ONCE_LINES", at_once_lines)
        patch.setattr(batch_file, "MAX_NEW_SHAPES", max_new_shapes)
        fast = _outcome(path, served)
        patch.setattr(batch_file, "lines_within_bounds", lambda block: False)  # every line the exact way
        exact = _outcome(path, served)
    assert fast == exact


def _spied_validation(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], int, int]:
    """Validate ``path``: the line numbers checked the exact way, how many lines had their rules
    checked the per-line way, and how many of those were judged for their shape."""
    exact_checks: list[int] = []
    rule_checks: list[object] = []
    shape_checks: list[bytes] = []
    validation = batch_file._Validation
    exact_check, rule_check, shape_check = (
        validation.check_line,
        validation.accepts,
        validation.shape_accepted,
    )

    def counted_exact_check(self: Any, line_number: int, raw: bytes) -> None:
        exact_checks.append(line_number)
        exact_check(self, line_number, raw)

    def counted_rule_check(self: Any, line: Any, *rest: Any) -> bool:
        rule_checks.append(line)
        return rule_check(self, line, *rest)

    def counted_shape_check(self: Any, url: str, raw: bytes) -> bool:
        shape_checks.append(raw)
        return shape_check(self, url, raw)

    monkeypatch.setattr(validation, "check_line", counted_exact_check)
    monkeypatch.setattr(validation, "accepts", counted_rule_check)
    monkeypatch.setattr(validation, "shape_accepted", counted_shape_check)
    summary = validate_batch_file(str(path), _model_set())
    assert summary.line_count == 3000
    return exact_checks, len(rule_checks), len(shape_checks)


def _write_lines(path: Path, endpoint: str, extra: Any) -> None:
    lines = []
    for number in range(3000):
        body: dict[str, Any] = {"model": "default", **extra(number)}
        body.update(
            {"messages": [{"role": "user", "content": f"q{number}"}]} if endpoint == CHAT else {"prompt": "q"}
        )
        lines.append(json.dumps({"custom_id": f"r{number}", "method": "POST", "url": endpoint, "body": body}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_lines_of_a_known_shape_are_accepted_without_the_per_line_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """Of 3,000 lines in two shapes, only the first is checked the exact way, and each shape's
    rules are checked once (the per-line way, on one of its lines)."""
    path = tmp_path / "input.jsonl"
    _write_lines(path, endpoint, lambda number: {"max_tokens": 4 + number % 2})
    assert _spied_validation(path, monkeypatch) == ([1], 2, 2)


def test_lines_of_many_shapes_are_checked_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines that each have a shape of their own (their own ``seed``) are not judged by shape
    (nor is each shape remembered): each line's rules are checked once, the per-line way."""
    path = tmp_path / "input.jsonl"
    _write_lines(path, CHAT, lambda number: {"seed": number})
    assert _spied_validation(path, monkeypatch) == ([1], 2999, 0)


@pytest.mark.parametrize("copied", [7, 19_990], ids=["nearby", "in an earlier block"])
def test_a_duplicate_custom_id_among_many_lines_is_reported_at_its_line(tmp_path: Path, copied: int) -> None:
    line = json.dumps(
        {
            "custom_id": "{}",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )
    ids = [f"r{number}" for number in range(20_000)]
    ids.insert(copied + 3, ids[copied])
    path = tmp_path / "input.jsonl"
    path.write_text("".join(line.replace("{}", custom_id) + "\n" for custom_id in ids))
    with pytest.raises(InvalidBatchFile) as raised:
        validate_batch_file(str(path), _model_set())
    assert [(problem.line, problem.message) for problem in raised.value.problems] == [
        (copied + 4, f"duplicate custom_id 'r{copied}'")
    ]


def _first_look_passes(line: bytes) -> bool:
    """The per-line first look of ``bounds_problem``: nothing to look at closely."""
    classes = line.translate(json_bounds._CLASSES)
    return classes.count(b"(") <= json_bounds.MAX_DEPTH and json_bounds._NINETEEN_DIGITS not in classes


_BOUNDS_LINES = st.lists(
    st.one_of(
        st.text(alphabet='[]{}0123456789,. "ax', max_size=200).map(str.encode),
        st.integers(0, 80).map(lambda depth: b"[" * depth + b"]" * depth),
        st.integers(15, 22).map(lambda digits: b"1" * digits),
    ),
    min_size=1,
    max_size=8,
)


@given(block_lines=_BOUNDS_LINES)
def test_the_block_first_look_at_bounds_passes_exactly_when_every_lines_does(
    block_lines: list[bytes],
) -> None:
    block = b"\n".join(block_lines)
    assert json_bounds.lines_within_bounds(block) == all(_first_look_passes(line) for line in block_lines)
