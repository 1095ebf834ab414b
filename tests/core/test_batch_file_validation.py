"""Validation's fast way (blocks, whole-line decode) decides exactly as its exact way, line by line.

``validate_batch_file`` checks most lines by decoding each whole line with one decoder and checking
the rest on the result, in blocks of whole lines; any line that fails that is checked again the
exact way, which says what is wrong. Hypothesis builds files of valid and broken lines (wrong
fields, other endpoints, duplicates, out-of-range parameters, models not served, bad UTF-8, deep
nesting, huge integers, blank and CRLF lines, a last line without a newline) and checks that the
result, accepted or the problems reported, is the one the exact way alone gives, whatever the
block size, with served model names or with the service's models (a ``ModelSet``, whose
``check_line`` and one-model-per-file rule the fast way must apply too; embeddings and responses
lines, which have no whole-line decoder, go the exact way). It also checks the block-wide first
look of the JSON bounds against the per-line one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.core import batch_file, json_bounds
from batchgen.core.backends.capabilities import Capabilities
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.core.batch_file import LineRouter, validate_batch_file
from batchgen.core.errors import InvalidBatchFile
from batchgen.core.models import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from batchgen.core.served_models import ModelSet, ServedModel

CHAT = CHAT_COMPLETIONS
SERVED = ("simulated", "default")


def _model_set() -> ModelSet:
    """Two models: the default serves chat and completions only; "other-model" serves every
    endpoint and feature."""
    everything = SimulatedBackend(model_name="other-model")
    everything.capabilities = Capabilities(  # type: ignore[attr-defined]
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


@settings(max_examples=300, deadline=None)
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
