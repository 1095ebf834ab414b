"""Slow unauthenticated clients beside keyed ones: do keyed requests still succeed, does /health answer?

Starts ``batchgen-server`` (simulated backend, one API key, its defaults otherwise) on
127.0.0.1. A separate process plays a slow-loris attacker from 127.0.0.1: it holds
``--slow-connections`` connections (1,000), each sending one more byte of a request head every
``--byte-every-s`` (2 s) and never finishing it, and it reopens each one ``--reopen-after-s``
(10 s) after it opened, or at its next byte once the server has closed it. Meanwhile, from
127.0.0.2, ``--keyed-clients`` threads (3) each send a keyed ``GET /v1/models`` or
``GET /v1/batches`` about once a second on a fresh connection, and from 127.0.0.3 this script
asks ``GET /health`` twice a second (Linux routes all of 127/8 to the loopback interface).

Prints the share of keyed requests answered 200 (and what the others got), the /health latency
(median, p99, max), and how many connections the attacker had open; the last line is one JSON
object with the figures.

    python benchmarks/slow_clients.py [--duration-s 20] [--slow-connections 1000] [SERVER FLAGS…]

Arguments it does not know go to the server (``--max-header-connections-per-address 1000``
shows the server without the per-address cap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from running_server import running_server

PORT = 10994
ATTACKER_ADDRESS = "127.0.0.1"
KEYED_ADDRESS = "127.0.0.2"
HEALTH_ADDRESS = "127.0.0.3"


def create_key(storage: Path) -> str:
    """A key for tenant ``bench``, made with the real ``batchgen-server keys create``."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchgen.server.cli",
            "keys",
            "create",
            "--tenant",
            "bench",
            "--storage-path",
            str(storage),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout.strip().splitlines()[-1]


async def _hold_slow_connection(
    port: int, byte_every_s: float, reopen_after_s: float, stop: Any, held: list[int]
) -> None:
    """One attacker connection: a head that never ends, a byte at a time; reopened when it ends."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
    while not stop.is_set():
        opened = time.monotonic()
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(port=port, host="127.0.0.1", local_addr=(ATTACKER_ADDRESS, 0)), 10
            )
            held[0] += 1
            try:
                sent = 0
                while not stop.is_set() and time.monotonic() - opened < reopen_after_s:
                    writer.write(head[sent : sent + 1])
                    sent += 1
                    await writer.drain()
                    try:  # the server closing shows as the end of what it sends
                        if await asyncio.wait_for(reader.read(1), byte_every_s) == b"":
                            break
                    except TimeoutError:
                        continue
            finally:
                held[0] -= 1
        except (OSError, TimeoutError):
            pass
        finally:
            if writer is not None:
                writer.close()
        # reopen at the next byte's time, as slowloris tools do, not in a tight loop
        await asyncio.sleep(max(0.0, byte_every_s - (time.monotonic() - opened) % byte_every_s))


def attacker(
    port: int, connections: int, byte_every_s: float, reopen_after_s: float, stop: Any, held_report: Any
) -> None:
    """The slow-loris process: ``connections`` slow connections, their openings spread over a second."""

    async def main() -> None:
        held = [0]

        async def report() -> None:
            while not stop.is_set():
                held_report.value = held[0]
                await asyncio.sleep(0.2)

        async def delayed(index: int) -> None:
            await asyncio.sleep(index / connections)
            await _hold_slow_connection(port, byte_every_s, reopen_after_s, stop, held)

        await asyncio.gather(report(), *(delayed(index) for index in range(connections)))

    asyncio.run(main())


def keyed_client(base_url: str, key: str, stop: threading.Event, outcomes: list[str]) -> None:
    """Keyed requests about once a second, each on a fresh connection from 127.0.0.2."""
    paths = ("/v1/models", "/v1/batches")
    turn = 0
    while not stop.is_set():
        started = time.monotonic()
        transport = httpx.HTTPTransport(local_address=KEYED_ADDRESS)
        try:
            with httpx.Client(base_url=base_url, transport=transport, timeout=10) as client:
                answer = client.get(paths[turn % 2], headers={"Authorization": f"Bearer {key}"})
                outcomes.append(str(answer.status_code))
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)
        turn += 1
        stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))


def health_prober(base_url: str, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    """``GET /health`` from 127.0.0.3 twice a second, each on a fresh connection."""
    while not stop.is_set():
        started = time.monotonic()
        transport = httpx.HTTPTransport(local_address=HEALTH_ADDRESS)
        try:
            with httpx.Client(base_url=base_url, transport=transport, timeout=10) as client:
                status = client.get("/health").status_code
            latencies.append(time.monotonic() - started)
            if status != 200:
                failures.append(str(status))
        except httpx.HTTPError as exc:
            failures.append(type(exc).__name__)
        stop.wait(max(0.0, 0.5 - (time.monotonic() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=20.0, help="how long keyed clients run")
    parser.add_argument("--slow-connections", type=int, default=1000)
    parser.add_argument("--byte-every-s", type=float, default=2.0)
    parser.add_argument("--reopen-after-s", type=float, default=10.0)
    parser.add_argument("--keyed-clients", type=int, default=3)
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="attack alone before measuring")
    args, server_flags = parser.parse_known_args()
    base_url = f"http://127.0.0.1:{PORT}"
    with tempfile.TemporaryDirectory() as folder:
        storage = Path(folder) / "storage"
        storage.mkdir()
        key = create_key(storage)
        flags = ("--backend", "simulated", *server_flags)
        with running_server(storage, PORT, *flags):
            stop_attack = multiprocessing.Event()
            held = multiprocessing.Value("i", 0)
            slow = multiprocessing.Process(
                target=attacker,
                args=(PORT, args.slow_connections, args.byte_every_s, args.reopen_after_s, stop_attack, held),
            )
            slow.start()
            time.sleep(args.warm_up_s)
            held_at_start = held.value
            stop = threading.Event()
            outcomes: list[str] = []
            latencies: list[float] = []
            health_failures: list[str] = []
            threads = [
                threading.Thread(target=keyed_client, args=(base_url, key, stop, outcomes))
                for _ in range(args.keyed_clients)
            ]
            threads.append(
                threading.Thread(target=health_prober, args=(base_url, stop, latencies, health_failures))
            )
            for thread in threads:
                thread.start()
            held_samples = []
            deadline = time.monotonic() + args.duration_s
            while time.monotonic() < deadline:
                held_samples.append(held.value)
                time.sleep(0.5)
            stop.set()
            for thread in threads:
                thread.join(30)
            stop_attack.set()
            slow.join(30)
            if slow.is_alive():
                slow.kill()
    succeeded = outcomes.count("200")
    figures = {
        "slow_connections": args.slow_connections,
        "attacker_connections_open_median": statistics.median(held_samples)
        if held_samples
        else held_at_start,
        "keyed_requests": len(outcomes),
        "keyed_succeeded": succeeded,
        "keyed_success_share": round(succeeded / len(outcomes), 4) if outcomes else None,
        "keyed_failures": {
            outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes)) if outcome != "200"
        },
        "health_probes": len(latencies) + len(health_failures),
        "health_failures": {
            failure: health_failures.count(failure) for failure in sorted(set(health_failures))
        },
        "health_latency_median_s": round(statistics.median(latencies), 4) if latencies else None,
        "health_latency_p99_s": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))], 4)
        if latencies
        else None,
        "health_latency_max_s": round(max(latencies), 4) if latencies else None,
        "server_flags": server_flags,
    }
    for name, value in figures.items():
        print(f"{name}: {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    main()
