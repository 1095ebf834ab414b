"""Finding backends through the ``batchgen.backends`` entry points, and what their specs declare.

Packages are made on the fly as ``*.dist-info`` folders on ``sys.path``, which is how an installed
distribution looks to ``importlib.metadata``.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchgen.core.backends import (
    BackendLoadError,
    BackendOption,
    BackendSpec,
    UnknownBackend,
    backend_names,
    backend_spec,
    backend_specs,
    load_backend,
)
from batchgen.core.backends.simulated import SimulatedBackend

BUILT_IN = {
    "transformers": "batchgen.core.backends.hf_transformers",
    "sglang": "batchgen.core.backends.sglang_engine",
    "openai": "batchgen.core.backends.openai_upstream",
    "simulated": "batchgen.core.backends.simulated",
    "embeddings": "batchgen.core.backends.hf_embeddings",
    "vllm": "batchgen.core.backends.vllm_engine",
}


def _install(site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A distribution ``dist`` in ``site``: its dist-info with the entry points, and its modules."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[batchgen.backends]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))


def test_the_built_in_backends_are_found_through_their_entry_points() -> None:
    assert set(BUILT_IN) <= set(backend_names())
    for name, module in BUILT_IN.items():
        spec = backend_spec(name)
        assert spec.name == name
        assert spec.factory.__module__ == module
        assert spec.summary


def test_load_backend_builds_the_named_backend_with_its_options() -> None:
    backend = load_backend("simulated", seed=5, latency_s=0.5)
    assert isinstance(backend, SimulatedBackend)
    assert (backend.seed, backend.latency_s) == (5, 0.5)


def test_an_unknown_name_lists_the_installed_backends() -> None:
    with pytest.raises(UnknownBackend) as raised:
        load_backend("nope")
    message = str(raised.value)
    assert message.startswith("unknown backend 'nope'; installed backends: ")
    for name in BUILT_IN:
        assert name in message


def test_declared_options_are_keywords_of_the_factory_with_its_defaults() -> None:
    specs, failures = backend_specs()
    assert not failures
    for spec in specs:
        parameters = inspect.signature(spec.factory).parameters
        for option in spec.options:
            assert option.keyword in parameters, f"{spec.name}: {option.keyword}"
            declared = parameters[option.keyword].default
            if option.required:
                continue
            if option.repeatable:
                assert option.default in (None, ()) and declared in (None, ()), f"{spec.name}: {option.flag}"
            else:
                assert option.default == declared, f"{spec.name}: {option.flag}"
        for keyword in (spec.context_length_keyword, spec.cache_dir_keyword):
            assert keyword is None or keyword in parameters, f"{spec.name}: {keyword}"


def test_listing_and_loading_every_backend_imports_no_engine() -> None:
    code = (
        "import sys\n"
        "import batchgen.core\n"
        "from batchgen.core.backends import backend_specs\n"
        "specs, failures = backend_specs()\n"
        "assert not failures, failures\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'sglang'})\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_package_installed_at_runtime_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = """
        from batchgen.core.backends import BackendOption, BackendSpec
        from batchgen.core.backends.simulated import SimulatedBackend

        def build(*, words_seed: int = 0):
            return SimulatedBackend(seed=words_seed, model_name="extra")

        SPEC = BackendSpec(
            "extra", build, "another backend", (BackendOption("words_seed", "--extra-seed", int, 0),)
        )
    """
    _install(tmp_path, "batchgen_extra", {"extra": "batchgen_extra:SPEC"}, {"batchgen_extra": source})
    assert "extra" not in backend_names()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "extra" in backend_names()
    backend = load_backend("extra", words_seed=3)
    assert isinstance(backend, SimulatedBackend) and backend.seed == 3 and backend.model_name == "extra"
    sys.modules.pop("batchgen_extra", None)


def test_broken_registrations_are_reported_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_simulated = "from batchgen.core.backends.simulated import SPEC\n"
    _install(
        tmp_path,
        "batchgen_broken",
        {
            "missing": "batchgen_broken_missing:SPEC",
            "not-a-spec": "batchgen_broken_plain:SPEC",
            "misnamed": "batchgen_broken_misnamed:SPEC",
            "simulated": "batchgen_broken_misnamed:SPEC",
        },
        {"batchgen_broken_plain": "SPEC = object()\n", "batchgen_broken_misnamed": from_simulated},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        BackendLoadError, match=r"'missing' \(batchgen_broken_missing:SPEC in batchgen_broken"
    ):
        backend_spec("missing")
    with pytest.raises(BackendLoadError, match="is a object, not a BackendSpec"):
        backend_spec("not-a-spec")
    with pytest.raises(BackendLoadError, match="calls itself 'simulated'"):
        backend_spec("misnamed")
    with pytest.raises(BackendLoadError, match=r"'simulated' is registered twice: .* and .*; uninstall one"):
        backend_spec("simulated")
    with pytest.raises(BackendLoadError, match=r"in batchgen-core \d"):
        backend_spec("simulated")
    specs, failures = backend_specs()
    assert set(failures) == {"missing", "not-a-spec", "misnamed", "simulated"}
    assert {"transformers", "openai", "sglang"} <= {spec.name for spec in specs}
    for module in ("batchgen_broken_plain", "batchgen_broken_misnamed"):
        sys.modules.pop(module, None)


def test_a_spec_refuses_what_the_server_could_not_make_flags_of() -> None:
    def build() -> SimulatedBackend:
        return SimulatedBackend()

    with pytest.raises(ValueError, match="must look like --some-flag"):
        BackendOption("seed", "-s")
    with pytest.raises(ValueError, match="must look like --some-flag"):
        BackendOption("seed", "--seed", aliases=("--Seed",))
    with pytest.raises(ValueError, match="repeatable"):
        BackendOption("urls", "--url", repeatable=True, default=["http://a"])
    with pytest.raises(ValueError, match="declares the flag --a twice"):
        BackendSpec("x", build, "x", (BackendOption("a", "--a"), BackendOption("b", "--b", aliases=("--a",))))
    with pytest.raises(ValueError, match="declares the keyword a twice"):
        BackendSpec("x", build, "x", (BackendOption("a", "--a"), BackendOption("a", "--b")))
    with pytest.raises(ValueError, match="name"):
        BackendSpec("Not A Name", build, "x")
