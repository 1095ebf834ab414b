"""The result cache's parts: which requests it may answer, the keys, and the bounded LRU store.

The keys: Hypothesis over request bodies (any JSON object, its keys in any order and spaced any
way) and over what must keep entries apart (tenant, model, endpoint, resolved sampling). The
store: a Hypothesis state machine against a model of an LRU cache, reopened at random (a
restart), its file never over either bound.
"""

from __future__ import annotations

import json
import random
import sqlite3
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from batchgen.core.backends.capabilities import GREEDY, SEEDED, Capabilities
from batchgen.core.execution.result_cache import CachedResult, ResultCache, ResultCacheSettings, entry_size
from batchgen.core.execution.result_cache_keys import cache_key, canonical_body, is_deterministic
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    GenerationRequest,
    SamplingParameters,
)
from tests.examples import examples

_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
_bodies = st.dictionaries(st.text(min_size=1, max_size=6), _json, min_size=1, max_size=6)
MODEL = ("default", "simulated", "")


def _request(
    endpoint: str = CHAT_COMPLETIONS,
    temperature: float = 0.0,
    seed: int | None = None,
    n: int | None = None,
    max_tokens: int = 16,
) -> GenerationRequest:
    options = {} if n is None else {"n": n}
    return GenerationRequest(
        "req_1", endpoint, SamplingParameters(max_tokens, temperature=temperature, seed=seed), options=options
    )


def _shuffled(value: Any, rng: random.Random) -> Any:
    """``value`` with the keys of every object in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: _shuffled(item, rng) for key, item in items}
    if isinstance(value, list):
        return [_shuffled(item, rng) for item in value]
    return value


@given(body=_bodies, seed=st.integers(0, 1000), indent=st.none() | st.integers(0, 4))
def test_key_order_and_whitespace_do_not_change_the_key(
    body: dict[str, Any], seed: int, indent: int | None
) -> None:
    rng = random.Random(seed)
    variant = json.dumps(_shuffled(body, rng), indent=indent, separators=(" , ", " : ")).encode()
    compact = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert canonical_body(variant) == canonical_body(compact)
    request = _request()
    assert cache_key("t", MODEL, CHAT_COMPLETIONS, variant, request) == cache_key(
        "t", MODEL, CHAT_COMPLETIONS, compact, request
    )


@given(
    body=_bodies,
    tenants=st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=2, unique=True),
    models=st.lists(
        st.tuples(st.text(max_size=4), st.text(max_size=4), st.text(max_size=4)),
        min_size=2,
        max_size=2,
        unique=True,
    ),
    endpoints=st.lists(
        st.sampled_from([CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES]),
        min_size=2,
        max_size=2,
        unique=True,
    ),
)
def test_tenants_models_and_endpoints_never_share_a_key(
    body: dict[str, Any], tenants: list[str], models: list[tuple[str, str, str]], endpoints: list[str]
) -> None:
    raw = json.dumps(body).encode()
    request = _request()
    base = cache_key(tenants[0], models[0], endpoints[0], raw, request)
    assert cache_key(tenants[1], models[0], endpoints[0], raw, request) != base
    assert cache_key(tenants[0], models[1], endpoints[0], raw, request) != base
    assert cache_key(tenants[0], models[0], endpoints[1], raw, request) != base


@given(
    first=st.tuples(st.integers(1, 64), st.sampled_from([0.0, 0.7]), st.none() | st.integers(0, 9)),
    second=st.tuples(st.integers(1, 64), st.sampled_from([0.0, 0.7]), st.none() | st.integers(0, 9)),
)
def test_the_resolved_sampling_is_part_of_the_key(
    first: tuple[int, float, int | None], second: tuple[int, float, int | None]
) -> None:
    """A line that sets nothing takes the batch's parameters: two such lines differ by those."""
    raw = b'{"model":"default","messages":[]}'
    one = cache_key(
        "t", MODEL, CHAT_COMPLETIONS, raw, _request(max_tokens=first[0], temperature=first[1], seed=first[2])
    )
    two = cache_key(
        "t",
        MODEL,
        CHAT_COMPLETIONS,
        raw,
        _request(max_tokens=second[0], temperature=second[1], seed=second[2]),
    )
    assert (one == two) is (first == second)


@given(
    temperature=st.sampled_from([0.0, 0.2, 1.0, 2.0]),
    seed=st.none() | st.integers(0, 2**31),
    n=st.none() | st.integers(1, 4),
    declared=st.sets(st.sampled_from([GREEDY, SEEDED])),
)
def test_non_deterministic_requests_are_never_cached(
    temperature: float, seed: int | None, n: int | None, declared: set[str]
) -> None:
    capabilities = Capabilities(deterministic=frozenset(declared))
    request = _request(temperature=temperature, seed=seed, n=n)
    cacheable = is_deterministic(request, capabilities)
    if n not in (None, 1) or (temperature > 0 and seed is None):  # several choices, or unseeded sampling
        assert not cacheable
    elif temperature > 0:  # seeded: where the backend honours seeds
        assert cacheable is (SEEDED in declared)
    else:  # greedy: where the backend repeats greedy answers
        assert cacheable is (GREEDY in declared)
    embeddings = _request(EMBEDDINGS, temperature=temperature, seed=seed)
    assert is_deterministic(embeddings, capabilities) is (GREEDY in declared)


def test_every_builtin_backend_declares_what_it_repeats() -> None:
    from batchgen.core.backends.hf_embeddings import EmbeddingsBackend
    from batchgen.core.backends.hf_transformers import TransformersBackend
    from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
    from batchgen.core.backends.sglang_engine import SGLangBackend
    from batchgen.core.backends.simulated import SimulatedBackend

    assert SimulatedBackend.capabilities.deterministic == {GREEDY, SEEDED}
    assert TransformersBackend.capabilities.deterministic == {GREEDY, SEEDED}
    assert SGLangBackend.capabilities.deterministic == {GREEDY, SEEDED}
    assert OpenAIUpstreamBackend.capabilities.deterministic == {GREEDY}  # an upstream's seed is best effort
    assert EmbeddingsBackend.capabilities.deterministic == {GREEDY}
    assert Capabilities().deterministic == frozenset()  # a backend that declares nothing: never cached


# --- the store ----------------------------------------------------------------------------------


def _file_contents(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT key, size FROM entries").fetchall())


class StoreMachine(RuleBasedStateMachine):
    """The store against an LRU model, under small bounds, written now (``store``) or later
    (``store_later``, then ``flush``), reopened at random."""

    KEYS = st.sampled_from([f"k{i}" for i in range(9)])

    def __init__(self) -> None:
        super().__init__()
        self.path = Path(tempfile.mkdtemp(prefix="result-cache-")) / "result_cache.sqlite3"
        self.settings = ResultCacheSettings(("t",), max_bytes=900, max_entries=5)
        self.cache = ResultCache(self.path, self.settings)
        #: What the file holds (key: size), least recently used first, and the bodies.
        self.model: OrderedDict[str, int] = OrderedDict()
        self.bodies: dict[str, bytes] = {}
        #: What waits in memory: new entries, and keys used.
        self.pending: dict[str, bytes] = {}
        self.touched: OrderedDict[str, None] = OrderedDict()

    def _insert(self, key: str, body: bytes) -> None:
        size = entry_size(key, body)
        if size <= self.settings.max_bytes and key not in self.model:  # else: too big alone, or kept
            self.model[key] = size
            self.bodies[key] = body

    def _trim(self) -> None:
        while (
            len(self.model) > self.settings.max_entries or sum(self.model.values()) > self.settings.max_bytes
        ):
            self.model.popitem(last=False)

    def _written(self) -> None:
        """What a flush does: the uses first, then the new entries, then eviction."""
        for key in self.touched:
            if key in self.model:
                self.model.move_to_end(key)
        for key, body in self.pending.items():
            self._insert(key, body)
        self.pending, self.touched = {}, OrderedDict()
        self._trim()

    @rule(key=KEYS, length=st.integers(1, 300))
    def store(self, key: str, length: int) -> None:
        body = (key * length).encode()[:length]
        self.cache.store([(key, "t", CachedResult(body, length, 1))])
        self._insert(key, body)
        self._trim()

    @rule(key=KEYS, length=st.integers(1, 300))
    def store_later(self, key: str, length: int) -> None:
        body = (key * length).encode()[-length:]
        self.cache.store_later([(key, "t", CachedResult(body, length, 1))])
        self.pending.setdefault(key, body)

    @rule(key=KEYS)
    def lookup(self, key: str) -> None:
        found = self.cache.lookup([key])
        if key in self.pending:  # found in memory
            assert found[key].body == self.pending[key]
        elif key in self.model:
            assert found[key].body == self.bodies[key]
            self.touched.pop(key, None)
            self.touched[key] = None
        else:
            assert key not in found

    @rule()
    def flush(self) -> None:
        anyio.run(self.cache.flush)
        self._written()

    @rule(max_entries=st.integers(1, 6))
    def reopen(self, max_entries: int) -> None:
        """A clean restart (what waits is written), perhaps with another bound (a lower one
        trims the file at once)."""
        self.cache.close()
        self._written()
        self.settings = attrs.evolve(self.settings, max_entries=max_entries)
        self.cache = ResultCache(self.path, self.settings)
        self._trim()

    @invariant()
    def within_bounds_and_as_the_model_says(self) -> None:
        contents = _file_contents(self.path)
        assert set(contents) == set(self.model)
        assert len(contents) <= self.settings.max_entries
        assert sum(contents.values()) <= self.settings.max_bytes
        assert (self.cache.entries, self.cache.bytes) == (len(contents), sum(contents.values()))
        assert self.cache.waiting == len(self.pending)

    def teardown(self) -> None:
        self.cache.close()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=examples(30), stateful_step_count=30)


def test_a_damaged_cache_file_is_a_miss_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ResultCache(tmp_path / "c.sqlite3", ResultCacheSettings(("t",)))
    cache.store([("k", "t", CachedResult(b"{}", 1, 1))])
    cache._db.execute("DROP TABLE entries")  # what a damaged file looks like to the queries
    assert cache.lookup(["k"]) == {}
    cache.store([("j", "t", CachedResult(b"{}", 1, 1))])  # logged, not raised
    assert "result cache" in caplog.text
    cache.close()
