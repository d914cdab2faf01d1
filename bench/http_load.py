"""The load generator for `POST /sessions/{id}/turns`: its own process, never the service's.

Usage: python bench/http_load.py --port P[,P2...] --key K --sessions FILE [--connections 32]
       [--seconds 10] [--warmup 2] [--begin-at EPOCH] [--latencies]

Each connection is a keep-alive HTTP/1.1 connection on plain asyncio streams (a full client
library would cost more CPU than the server it measures, on a 2-core machine). A connection
posts one turn to the next unused session (a session takes one turn: the next would be 409
`session-busy`, as no worker claims the run), with a unique `Idempotency-Key`, waits for the
answer, and posts the next. Requests answered during the warm-up are not counted. Prints one
JSON object: requests, statuses, requests/s, latency percentiles in ms, and this process's own
CPU time (so a reader can see that the load generator was not the limit).

Several ports: connection i goes to port i mod n, as a round-robin load balancer would spread
them over API processes (without a balancer's own cost). Several load generator processes:
`bench/run.py` starts them with disjoint session files and one `--begin-at` (wall clock), so
their warm-ups and measurement windows coincide, and merges their `--latencies`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import Counter
from pathlib import Path


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    return status


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", required=True, help="one port, or several separated by commas")
    parser.add_argument("--key", required=True)
    parser.add_argument("--sessions", type=Path, required=True)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument(
        "--begin-at",
        type=float,
        default=None,
        help="wall-clock time (epoch seconds) at which the warm-up begins; default: now",
    )
    parser.add_argument(
        "--latencies", action="store_true", help="include every measured latency (ms)"
    )
    args = parser.parse_args()
    ports = [int(port) for port in args.port.split(",")]
    if args.begin_at is not None:
        await asyncio.sleep(max(0.0, args.begin_at - time.time()))
    cpu_started = time.process_time()
    sessions = iter(args.sessions.read_text().split())
    body = json.dumps({"input": {"text": "hello"}}).encode()
    latencies: list[float] = []
    statuses: Counter[int | str] = Counter()
    started = time.monotonic()
    measure_from = started + args.warmup
    stop_at = measure_from + args.seconds
    exhausted = False
    total = 0  # every answered request, warm-up included

    async def connection(port: int) -> None:
        nonlocal exhausted, total
        reader, writer = await asyncio.open_connection(args.host, port)
        try:
            while time.monotonic() < stop_at:
                if writer.is_closing():
                    # The server closed or reset the last connection: a new one, as a client
                    # with a pool would (the failed request is counted, not retried).
                    reader, writer = await asyncio.open_connection(args.host, port)
                session = next(sessions, None)
                if session is None:
                    exhausted = True
                    return
                request = (
                    f"POST /sessions/{session}/turns HTTP/1.1\r\n"
                    f"Host: {args.host}:{port}\r\n"
                    f"Authorization: Bearer {args.key}\r\n"
                    f"Idempotency-Key: {uuid.uuid4().hex}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode() + body
                sent = time.monotonic()
                try:
                    writer.write(request)
                    status: int | str = await read_response(reader)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    status = f"connection error ({type(exc).__name__})"
                    writer.close()
                done = time.monotonic()
                total += 1
                if sent >= measure_from and done <= stop_at:
                    latencies.append((done - sent) * 1000)
                    statuses[status] += 1
        finally:
            writer.close()

    await asyncio.gather(*(connection(ports[i % len(ports)]) for i in range(args.connections)))
    window = min(time.monotonic(), stop_at) - measure_from
    elapsed = time.monotonic() - started
    # User + system time of this process, warm-up included (per request: requests_total).
    cpu = time.process_time() - cpu_started
    report: dict[str, object] = {
        "connections": args.connections,
        "seconds": round(window, 3),
        "requests": len(latencies),
        "requests_total": total,
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "sessions_exhausted": exhausted,
        "requests_per_second": round(len(latencies) / window, 1) if window > 0 else None,
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else None,
        "client_cpu_seconds": round(cpu, 3),
        # The share of one core this process used from its first request to its last:
        # well under 1, it was waiting on the servers, not the other way round.
        "client_cpu_share": round(cpu / elapsed, 3) if elapsed > 0 else None,
    }
    if args.latencies:
        report["latencies_ms"] = [round(ms, 3) for ms in latencies]
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
