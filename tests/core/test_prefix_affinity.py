"""Prefix affinity in the ``openai`` backend: a prompt prefix's requests go to one upstream.

The policy (``upstream_concurrency.prefix_home``, ``choose_upstream`` with a prefix key) is tested
as plain objects: rendezvous hashing moves only the keys an added or removed upstream wins, a
first attempt goes to its prefix's upstream while it has room, spills to the least loaded one when
it is full, goes to the next by weight while it is down, and retries ignore the key.

The backend is then run against real HTTP servers on 127.0.0.1 (``RecordingUpstream``: a threaded
OpenAI-compatible server in this process that records which prompts it was sent, and can hold its
answers or be shut down): a fleet of three gets every request of a prefix on that prefix's
upstream; with one slot per upstream and the prefix's upstream holding a request, the next
request of that prefix goes to another upstream and is counted ``saturated``; with that upstream
shut down, its prefix's requests all go to one other upstream and are counted ``down``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.core.backends.openai_upstream import OpenAIUpstreamBackend
from batchgen.core.backends.upstream_concurrency import (
    AdaptiveLimit,
    UpstreamHealth,
    UpstreamState,
    choose_upstream,
    prefix_home,
)
from batchgen.core.models import GenerationRequest, SamplingParameters
from batchgen.core.requests.prefix_keys import prefix_key

MODEL = "m"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _state(url: str, limit: int = 4) -> UpstreamState:
    return UpstreamState(url=url, limit=AdaptiveLimit(maximum=limit, initial=limit), health=UpstreamHealth())


# --- the policy -------------------------------------------------------------------------------------


@given(
    keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50, unique=True),
    count=st.integers(2, 6),
    removed=st.integers(0, 5),
)
def test_removing_an_upstream_moves_only_the_prefixes_it_won(
    keys: list[int], count: int, removed: int
) -> None:
    removed %= count
    fleet = [_state(f"http://10.0.0.{i}:8000/v1") for i in range(count)]
    before = {key: prefix_home(fleet, key) for key in keys}
    fewer = [upstream for i, upstream in enumerate(fleet) if i != removed]
    for key in keys:
        after = fewer[prefix_home(fewer, key)]  # type: ignore[index]
        if before[key] != removed:
            assert after is fleet[before[key]], "a prefix moved though its upstream stayed"  # type: ignore[index]
    fleet[removed].health.down = True  # down is the same as removed, for the prefixes' homes
    for key in keys:
        home = prefix_home(fleet, key)
        assert home is not None and fleet[home] is fewer[prefix_home(fewer, key)]  # type: ignore[index]


def test_keys_spread_over_the_upstreams() -> None:
    fleet = [_state(f"http://gpu{i}:30000/v1") for i in range(4)]
    keys = [prefix_key(MODEL, prompt=f"prefix {n} " * 80) for n in range(400)]
    homes = [prefix_home(fleet, key) for key in keys if key is not None]
    assert all(60 <= homes.count(i) <= 140 for i in range(4)), [homes.count(i) for i in range(4)]


def test_a_first_attempt_goes_home_while_it_has_room_then_spills_to_the_least_loaded() -> None:
    fleet = [_state(f"http://gpu{i}:30000/v1", limit=2) for i in range(3)]
    key = 12345
    home = prefix_home(fleet, key)
    assert home is not None
    others = [i for i in range(3) if i != home]
    fleet[home].in_flight = 1
    fleet[others[0]].in_flight = 0
    assert choose_upstream(fleet, prefix=key) == home, "home had a free slot"
    assert choose_upstream(fleet) == others[0] or choose_upstream(fleet) == others[1], "no key: least loaded"
    fleet[home].in_flight = 2  # full
    fleet[others[1]].in_flight = 1
    assert choose_upstream(fleet, prefix=key) == others[0], "full home: the least loaded one"
    fleet[home].in_flight = 0
    assert choose_upstream(fleet, tried={home: 1}, prefix=key) != home, "a retry ignores the key"
    fleet[home].health.down = True
    second = prefix_home(fleet, key)
    assert second in others
    fleet[others[0]].in_flight = fleet[others[1]].in_flight = 0
    assert choose_upstream(fleet, prefix=key) == second, "home down: the next by weight"
    assert choose_upstream(fleet, prefix=key, eligible={others[0]}) == others[0], "only eligible ones"


# --- real HTTP upstreams --------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # every request of a test may connect at once (the default is 5)


class RecordingUpstream:
    """An OpenAI-compatible server on 127.0.0.1 that records the last message of each chat it is
    sent; while ``hold`` is clear, answers wait for it."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.waiting = threading.Semaphore(0)
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.received.append(request["messages"][-1]["content"])
                upstream.waiting.release()
                upstream.hold.wait(30)
                self._answer(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "ok"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                    }
                )

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet() -> Any:
    upstreams = [RecordingUpstream() for _ in range(3)]
    yield upstreams
    for upstream in upstreams:
        upstream.close()


def _chat(prefix: int, item: int) -> GenerationRequest:
    messages = (
        {"role": "system", "content": f"Prefix {prefix}: " + "the shared instructions and examples. " * 20},
        {"role": "user", "content": f"p{prefix}-i{item}"},
    )
    return GenerationRequest(
        request_id=f"req-{prefix}-{item}",
        endpoint="/v1/chat/completions",
        sampling=SamplingParameters(max_tokens=1),
        messages=messages,
        model=MODEL,
    )


def _key(prefix: int) -> int:
    key = prefix_key(MODEL, messages=_chat(prefix, 0).messages)
    assert key is not None
    return key


def _where(fleet: list[RecordingUpstream], prefix: int) -> set[int]:
    return {
        i for i, upstream in enumerate(fleet) for item in upstream.received if item.startswith(f"p{prefix}-")
    }


@pytest.mark.anyio
async def test_every_request_of_a_prefix_goes_to_its_upstream(fleet: list[RecordingUpstream]) -> None:
    backend = OpenAIUpstreamBackend(
        upstreams=[u.url for u in fleet], initial_concurrency=64, max_concurrency=64
    )
    await backend.start()
    try:
        async with anyio.create_task_group() as tasks:
            for item in range(5):
                for prefix in range(8):
                    tasks.start_soon(backend.generate, _chat(prefix, item))
    finally:
        await backend.stop()
    for prefix in range(8):
        assert _where(fleet, prefix) == {prefix_home(backend.upstreams, _key(prefix))}, (
            f"prefix {prefix} was split"
        )
    assert sum(u.affinity["kept"] for u in backend.upstreams) == 40
    assert sum(u.affinity["saturated"] + u.affinity["down"] for u in backend.upstreams) == 0


@pytest.mark.anyio
async def test_a_full_upstream_spills_its_prefix_and_a_down_one_hands_it_to_the_next(
    fleet: list[RecordingUpstream],
) -> None:
    backend = OpenAIUpstreamBackend(
        upstreams=[u.url for u in fleet], initial_concurrency=1, max_concurrency=1, probe_interval_s=60
    )
    await backend.start()
    try:
        home = prefix_home(backend.upstreams, _key(0))
        assert home is not None
        fleet[home].hold.clear()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(backend.generate, _chat(0, 0))
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(fleet[home].waiting.acquire)  # home's one slot is taken
            await backend.generate(_chat(0, 1))  # full home: another upstream answers it
            fleet[home].hold.set()
        assert fleet[home].received == ["p0-i0"]
        assert sum("p0-i1" in u.received for u in fleet) == 1
        assert backend.upstreams[home].affinity == {"kept": 1, "down": 0, "saturated": 1}

        fleet[home].close()  # nothing listens there now: down at the first attempt
        for item in range(2, 8):
            await backend.generate(_chat(0, item))
        assert backend.upstreams[home].health.down
        later = {
            i
            for i, upstream in enumerate(fleet)
            for got in upstream.received
            if got in {f"p0-i{n}" for n in range(3, 8)}
        }
        assert len(later) == 1 and home not in later, "while home is down its prefix has one other upstream"
        # i2 went home (kept) and found it gone; i3..i7 saw it down
        assert backend.upstreams[home].affinity == {"kept": 2, "down": 5, "saturated": 1}
    finally:
        await backend.stop()
