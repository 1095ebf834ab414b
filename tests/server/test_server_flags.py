"""``batchgen-server``'s flags: the server's own, and those made from each backend's declared options.

Every flag that existed before backends declared their own options keeps its name and its effect,
checked on the backend each builds. ``--help`` has a group per backend and shows each default
once; bad values and missing required options end in a usage error that says why.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends import BackendOption, BackendSpec, backend_spec
from batchgen.core.backends.hf_transformers import TransformersBackend
from batchgen.core.backends.hf_worker import WorkerOptions
from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
from batchgen.core.backends.sglang_engine import SGLangBackend
from batchgen.core.backends.simulated import SimulatedBackend
from batchgen.server import ServerSettings
from batchgen.server.backend_flags import backend_options
from batchgen.server.cli import build_parser, main, settings_from_args
from batchgen.server.priority import ApiNice, resolve_api_nice


def _built(*argv: str) -> Any:
    return settings_from_args(list(argv)).build_backend()


@pytest.mark.parametrize("model_flag", ["--model", "--model-path"])
def test_transformers_flags(model_flag: str, tmp_path: Path) -> None:
    backend = _built(
        "--storage-path",
        str(tmp_path),
        model_flag,
        "/models/tiny",
        "--device",
        "cpu",
        "--max-batch-size",
        "4",
        "--max-context-length",
        "100",
        "--dtype",
        "bfloat16",
    )
    assert isinstance(backend, TransformersBackend)
    assert backend.worker_options == WorkerOptions(
        model="/models/tiny",
        cache_dir=str(tmp_path / "models"),
        device="cpu",
        dtype="bfloat16",
        max_batch_size=4,
        context_length=100,
    )
    assert (backend.max_batch_size, backend.context_length) == (4, 100)


def test_transformers_dtype_is_one_of_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(["--dtype", "float8"])
    assert "--dtype" in capsys.readouterr().err


def test_the_default_backend_and_its_defaults() -> None:
    settings = settings_from_args([])
    assert settings.backend == "transformers"
    core = {"model": None, "device": None, "max_batch_size": 64, "dtype": "auto"}
    assert core.items() <= settings.backend_options.items()
    # every other option (the grammar bounds, ...) is its declared default
    declared = {option.keyword: option.default for option in backend_spec("transformers").options}
    assert settings.backend_options == declared
    assert settings.api_nice == "auto"
    backend = settings.build_backend()
    assert isinstance(backend, TransformersBackend)
    assert backend.worker_options.cache_dir == str(Path("batchgen-data") / "models")
    assert backend.worker_options.dtype == "auto"


@pytest.mark.parametrize("model_flag", ["--model", "--model-path"])
def test_sglang_flags(model_flag: str) -> None:
    backend = _built(
        "--backend",
        "sglang",
        model_flag,
        "/models/qwen",
        "--tp-size",
        "2",
        "--dp-size",
        "3",
        "--mem-fraction-static",
        "0.8",
        "--max-context-length",
        "2048",
        "--sglang-arg",
        "chunked-prefill-size=8192",
        "--sglang-arg",
        "served_model_name=my-model",
    )
    assert isinstance(backend, SGLangBackend)
    assert backend.engine_kwargs() == {
        "model_path": "/models/qwen",
        "tp_size": 2,
        "dp_size": 3,
        "mem_fraction_static": 0.8,
        "context_length": 2048,
        "chunked_prefill_size": 8192,
        "served_model_name": "my-model",
    }
    assert backend.model_name == "my-model"


def test_openai_flags() -> None:
    backend = _built(
        "--backend",
        "openai",
        "--upstream",
        "http://gpu1:30000/v1",
        "--upstream",
        "http://gpu2:30000",
        "--upstream-api-key",
        "sk-test",
        "--upstream-model",
        "qwen",
        "--upstream-max-concurrency",
        "8",
        "--upstream-initial-concurrency",
        "6",
        "--max-context-length",
        "512",
    )
    assert isinstance(backend, OpenAIUpstreamBackend)
    assert [upstream.url for upstream in backend.upstreams] == [
        "http://gpu1:30000/v1",
        "http://gpu2:30000/v1",
    ]
    assert (backend.api_key, backend.model_name, backend.context_length) == ("sk-test", "qwen", 512)
    assert {upstream.limit.maximum for upstream in backend.upstreams} == {8}
    assert {upstream.limit.limit for upstream in backend.upstreams} == {6}


def test_simulated_flags() -> None:
    backend = _built(
        "--backend",
        "simulated",
        "--simulated-latency-s",
        "0.5",
        "--simulated-token-latency-s",
        "0.01",
        "--simulated-failure-rate",
        "0.25",
        "--simulated-seed",
        "7",
        "--max-context-length",
        "64",
    )
    assert isinstance(backend, SimulatedBackend)
    assert (backend.latency_s, backend.token_latency_s, backend.failure_rate) == (0.5, 0.01, 0.25)
    assert (backend.seed, backend.context_length) == (7, 64)


def test_settings_built_in_code_take_the_backend_options_by_keyword() -> None:
    settings = ServerSettings(backend="simulated", backend_options={"seed": 3}, max_context_length=20)
    backend = settings.build_backend()
    assert isinstance(backend, SimulatedBackend)
    assert (backend.seed, backend.context_length) == (3, 20)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "sglang"], "--backend sglang needs --model-path"),
        (["--backend", "openai"], "--backend openai needs --upstream"),
        (["--backend", "openai", "--upstream", "gpu1:30000"], "--upstream must be an http(s) URL"),
        (
            ["--backend", "nope"],
            "invalid choice: 'nope' (choose from 'transformers', 'embeddings', 'openai', 'sglang'",
        ),
        (["--simulated-failure-rate", "2"], "--simulated-failure-rate: invalid value '2': must be between 0"),
        (["--tp-size", "0"], "--tp-size: invalid value '0': must be at least 1, got 0"),
        (["--sglang-arg", "no-equals"], "--sglang-arg: invalid value 'no-equals': expected KEY=VALUE"),
        (["--max-batch-size", "many"], "--max-batch-size: invalid value 'many'"),
    ],
)
def test_bad_flags_are_usage_errors_that_say_why(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the default storage folder is relative to the working directory: not the checkout's, which a
    # server started there with `nox -s serve` holds (its lock would be the refusal seen instead)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    # argparse's own errors (an invalid value) show the usage; refusals decided after parsing do not
    assert ("usage: batchgen-server" in error) is ("invalid" in message)
    assert message in error


def _wide_help(parser: argparse.ArgumentParser) -> str:
    """``--help`` with no line wrapping: each flag and its help on one line."""
    formatter = parser.formatter_class
    parser.formatter_class = lambda prog: formatter(prog, width=100_000, max_help_position=100)  # type: ignore[call-arg]
    return parser.format_help()


def test_help_shows_every_default_exactly_once() -> None:
    parser = build_parser()
    text = _wide_help(parser)
    for action in parser._actions:
        if not action.option_strings or action.default == argparse.SUPPRESS:
            continue
        [line] = [
            line for line in text.splitlines() if line.lstrip().startswith(action.option_strings[0] + " ")
        ]
        assert line.count("default:") <= 1, line
        if isinstance(action, argparse._StoreTrueAction):  # a switch: off unless given
            assert "(default:" not in line, line
        elif action.default not in (None, [], ()):
            assert line.count(f"(default: {action.default})") == 1, line


def test_help_has_a_group_per_backend_and_each_flag_once() -> None:
    text = _wide_help(build_parser())
    titles = re.findall(r"^(\S.*) backend(?: \(the default\))?:$", text, flags=re.MULTILINE)
    assert titles[0] == "transformers"
    assert {"transformers", "sglang", "openai", "simulated"} <= set(titles)
    options = re.findall(r"^  (--[a-z-]+)", text, flags=re.MULTILINE)
    assert len(options) == len(set(options))
    for flag in ("--model", "--tp-size", "--sglang-arg", "--upstream", "--simulated-seed", "--device"):
        assert flag in options
    [model] = [line for line in text.splitlines() if line.startswith("  --model MODEL, --model-path MODEL")]
    assert "transformers, vllm: a local Hugging Face folder or GGUF file" in model  # one text, said once
    assert "sglang: the model path" in model and "(required)" in model
    assert "also takes --model-path (above)" in text


def _build(**options: Any) -> SimulatedBackend:
    return SimulatedBackend(seed=options.get("seed", 0))


def _spec(name: str, *options: BackendOption) -> BackendSpec:
    return BackendSpec(name, _build, f"the {name} test backend", options)


def test_a_flag_declared_alike_by_two_backends_is_one_flag_for_both() -> None:
    first = _spec("first", BackendOption("seed", "--shared-seed", int, 0, "seed of the first"))
    second = _spec("second", BackendOption("words_seed", "--shared-seed", int, 0, "seed of the second"))
    problems: dict[str, str] = {}
    parser = build_parser([first, second], problems)
    assert problems == {}
    args = parser.parse_args(["--backend", "second", "--shared-seed", "5"])
    assert backend_options(args, first) == {"seed": 5}
    assert backend_options(args, second) == {"words_seed": 5}
    [line] = [line for line in _wide_help(parser).splitlines() if line.startswith("  --shared-seed")]
    assert line.endswith("first: seed of the first; second: seed of the second (default: 0)")


@pytest.mark.parametrize(
    ("clashing", "reason"),
    [
        (BackendOption("port", "--port", int, 1), "its option --port is also a flag of batchgen-server"),
        (
            BackendOption("seed", "--shared-seed", float, 0.0),
            "its option --shared-seed differs from the first backend's --shared-seed",
        ),
        (
            BackendOption("seed", "--other-seed", int, 0, aliases=("--shared-seed",)),
            "its option --shared-seed differs from the first backend's --shared-seed",
        ),
    ],
)
def test_a_backend_whose_flags_clash_is_left_out_with_the_reason(
    clashing: BackendOption, reason: str
) -> None:
    first = _spec("first", BackendOption("seed", "--shared-seed", int, 0))
    problems: dict[str, str] = {}
    parser = build_parser([first, _spec("second", clashing)], problems)
    assert list(problems) == ["second"] and problems["second"].startswith(reason)
    assert parser.parse_args(["--backend", "first"]).backend == "first"
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "second"])


@given(st.integers(min_value=-1000, max_value=1000))
def test_api_nice_takes_an_increment_from_0_to_19(value: int) -> None:
    if 0 <= value <= 19:
        assert settings_from_args(["--api-nice", str(value)]).api_nice == value
    else:
        with pytest.raises(SystemExit):
            settings_from_args(["--api-nice", str(value)])


@pytest.mark.parametrize("text", ["idle", "IDLE", " Idle ", "auto", "Auto"])
def test_api_nice_takes_idle_and_auto(text: str) -> None:
    assert settings_from_args(["--api-nice", text]).api_nice == text.strip().lower()
    with pytest.raises(SystemExit):
        settings_from_args(["--api-nice", text + "r"])


@pytest.mark.parametrize("setting", ["auto", "idle", 0, 5, 19])
@pytest.mark.parametrize("cpu_worker", [True, False])
def test_auto_is_idle_only_where_a_model_computes_on_the_cpu_in_a_worker(
    setting: ApiNice, cpu_worker: bool
) -> None:
    expected = ("idle" if cpu_worker else 10) if setting == "auto" else setting
    assert resolve_api_nice(setting, cpu_worker) == expected
