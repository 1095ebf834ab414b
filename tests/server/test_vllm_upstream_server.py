"""``batchgen-server --backend openai`` over a fleet of two real ``vllm serve`` upstreams.

Each upstream is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``)
serving the tiny random Llama on the CPU, with its prefix cache on and prompt token details in its
answers. Nothing is fetched from a hub.

Tests: a batch of prompts sharing a few long prefixes goes over both upstreams, each prefix to
its own upstream, and every request is counted by exactly the vLLM that BatchGen's metrics say
served it; the lines report the prefix cache's ``cached_tokens`` from vLLM's usage and the batch
sums them. One upstream killed mid-batch (its engine core with it) and the batch still ends with
every request exactly once, finished by the other.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgen.core.backends.openai_upstream import normalize_base_url
from batchgen.core.backends.upstream_concurrency import (
    AdaptiveLimit,
    UpstreamHealth,
    UpstreamState,
    prefix_home,
)
from batchgen.core.requests.prefix_keys import prefix_key
from tests.helpers import chat_line, file_lines, submit, wait_for_status
from tests.live import LiveServer, start_server
from tests.upstreams import Upstream, start_vllm_upstream

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.live]

#: Two vLLM servers starting side by side on two cores take a few minutes.
START_S = 600.0


@pytest.fixture
def vllm_upstreams(tiny_vllm_model: Path, tmp_path: Path) -> Iterator[list[Upstream]]:
    flags = ("--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 * 2**20))
    started = [start_vllm_upstream(tiny_vllm_model, tmp_path / f"vllm-{i}.log", *flags) for i in range(2)]
    try:
        for upstream in started:
            upstream.wait_ready(START_S)
        yield started
    finally:
        for upstream in started:
            upstream.kill()


@pytest.fixture
def batchgen(tmp_path: Path, vllm_upstreams: list[Upstream]) -> Iterator[list[LiveServer]]:
    servers: list[LiveServer] = []
    yield servers
    for server in servers:
        server.stop()


def _start(servers: list[LiveServer], upstreams: list[Upstream], storage: Path, *flags: str) -> LiveServer:
    upstream_flags = [arg for upstream in upstreams for arg in ("--upstream", upstream.url)]
    server = start_server(storage, "--backend", "openai", *upstream_flags, *flags)
    servers.append(server)
    return server


def _samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _vllm_finished(upstream: Upstream) -> int:
    """Requests this vLLM server finished, by its own metrics."""
    samples = _samples(upstream.root_url)
    return round(sum(value for (name, _), value in samples.items() if name == "vllm:request_success_total"))


def _label(upstream: Upstream) -> str:
    return upstream.url.removeprefix("http://").removesuffix("/v1")


def _split_prefixes(url: str, upstreams: list[Upstream], per_upstream: int) -> tuple[list[str], list[str]]:
    """Long prompt prefixes, ``per_upstream`` of them homed on each upstream by the backend's own
    rendezvous hashing, and the label of each one's home. Six arbitrary prefixes all land on one
    of two upstreams once in 32 fleets (the weights follow the URLs, whose ports are random), so
    the test picks prefixes that split and then checks that the server sent them where it says."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["root"]
    states = [
        UpstreamState(
            url=normalize_base_url(upstream.url), limit=AdaptiveLimit(maximum=4), health=UpstreamHealth()
        )
        for upstream in upstreams
    ]
    chosen: dict[int, list[str]] = {index: [] for index in range(len(upstreams))}
    for candidate in itertools.count():
        prefix = " ".join(f"rule{candidate}-{n}" for n in range(120))
        key = prefix_key(model, messages=[{"role": "user", "content": f"{prefix} Item 0."}])
        assert key is not None
        home = prefix_home(states, key)
        assert home is not None
        if len(chosen[home]) < per_upstream:
            chosen[home].append(prefix)
        if all(len(prefixes) == per_upstream for prefixes in chosen.values()):
            break
    pairs = [(prefix, _label(upstreams[index])) for index, prefixes in chosen.items() for prefix in prefixes]
    return [prefix for prefix, _ in pairs], [label for _, label in pairs]


def test_prefixes_go_to_their_own_vllm_and_report_its_cache_hits(
    batchgen: list[LiveServer], vllm_upstreams: list[Upstream], tmp_path: Path
) -> None:
    # four requests at a time: never more than an upstream's first concurrency limit, so no
    # request finds its prefix's upstream full and spills over to the other
    server = _start(batchgen, vllm_upstreams, tmp_path / "storage", "--max-pool-size", "4")
    prefixes, homes = _split_prefixes(server.base_url, vllm_upstreams, per_upstream=3)

    def line(p: int, item: int) -> dict[str, object]:
        return chat_line(f"p{p}-{item}", f"{prefixes[p]} Item {item}.", max_tokens=4)

    # one line of each prefix first, so that the rest find their prefix computed (requests sent
    # in one engine step do not share blocks they are still computing)
    first = [line(p, 0) for p in range(len(prefixes))]
    rest = [line(p, item) for item in range(1, 5) for p in range(len(prefixes))]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        ended = []
        for lines in (first, rest):
            batch = submit(client, lines)
            done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=300)
            assert done["status"] == "completed", done
            assert done["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
            output = file_lines(client, done["output_file_id"])
            assert Counter(out["custom_id"] for out in output) == Counter(x["custom_id"] for x in lines)
            ended.append((done, output))
        ours = _samples(server.base_url)
    kept = {
        _label(upstream): ours[
            (
                "batchgen_upstream_prefix_requests_total",
                frozenset({("upstream", _label(upstream)), ("affinity", "kept")}),
            )
        ]
        for upstream in vllm_upstreams
    }
    # every request went to its prefix's upstream (five lines of each of its three prefixes),
    # and that vLLM counted it
    assert kept == {_label(upstream): 15 for upstream in vllm_upstreams}, (kept, homes)
    assert {label: _vllm_finished(u) for label, u in zip(kept, vllm_upstreams, strict=True)} == kept
    # the later lines found their prefix's blocks in the cache of the upstream that served it
    done, output = ended[1]
    usages = [out["response"]["body"]["usage"] for out in output]
    assert all(u["prompt_tokens"] // 2 <= u["prompt_tokens_details"]["cached_tokens"] for u in usages), usages
    assert all(u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"] for u in usages), usages
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == cached


def test_a_vllm_upstream_killed_mid_batch_loses_nothing(
    batchgen: list[LiveServer], vllm_upstreams: list[Upstream], tmp_path: Path
) -> None:
    server = _start(batchgen, vllm_upstreams, tmp_path / "storage", "--upstream-max-concurrency", "4")
    lines = [chat_line(f"q{n}", f"Question {n}", max_tokens=300) for n in range(40)]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        batch = submit(client, lines)
        deadline = time.monotonic() + 300
        while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 4:
            assert time.monotonic() < deadline, "no request finished"
            time.sleep(0.05)
        vllm_upstreams[0].kill()  # the API server and its engine core, mid-request
        counts = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]
        assert counts["completed"] < 40, "the batch ended before the kill"
        done = wait_for_status(client, batch["id"], {"completed", "failed"}, timeout_s=300)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
        output = file_lines(client, done["output_file_id"])
        assert client.get("/health").status_code == 200  # the other upstream still serves
    assert Counter(line["custom_id"] for line in output) == Counter(f"q{n}" for n in range(40))
    assert all(line["error"] is None for line in output)
    assert all(1 <= line["response"]["body"]["usage"]["completion_tokens"] <= 300 for line in output)
    assert f"upstream {vllm_upstreams[0].url} is down" in server.log_path.read_text()
    assert _vllm_finished(vllm_upstreams[1]) >= 40 - counts["completed"]
