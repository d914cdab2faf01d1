"""What the benchmark's phases share: scratch databases, the service's processes, timing
helpers. bench/run.py and the phases in their own modules (inflight.py, peers.py) import it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from app.config import Settings
from app.queue.core import Queue
from app.store.embedded import start_embedded
from app.store.migrate import upgrade

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test suite's database helpers, shared rather than repeated

from tests.support.databases import admin_execute, with_database  # noqa: E402

TURNSTILE = str(Path(sys.executable).parent / "turnstile")
NOOP = {"script": [{"final": "ok"}]}
T = TypeVar("T")


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50_ms": _round(percentile(values, 50)),
        "p95_ms": _round(percentile(values, 95)),
        "p99_ms": _round(percentile(values, 99)),
        "max_ms": _round(max(values) if values else None),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# --- databases --------------------------------------------------------------------------------
async def server_url() -> str:
    for name in ("DATABASE_URL", "TURNSTILE_DATABASE_URL", "TEST_DATABASE_URL"):
        if os.environ.get(name):
            return os.environ[name]
    data_dir = Settings().data_dir  # TURNSTILE_DATA_DIR, `.turnstile` by default
    return (await asyncio.to_thread(start_embedded, ROOT / data_dir)).url


class Databases:
    """Scratch databases on one server: a migrated template, and fresh clones of it."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.prefix = f"turnstile_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.template = f"{self.prefix}_template"
        self.count = 0

    def url(self, name: str) -> str:
        return with_database(self.server, name)

    async def _admin(self, statement: str) -> None:
        await admin_execute(self.server, statement)

    async def create_template(self) -> None:
        await self._admin(f'CREATE DATABASE "{self.template}"')
        await asyncio.to_thread(upgrade, self.url(self.template))

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[str]:
        self.count += 1
        name = f"{self.prefix}_{self.count}"
        await self._admin(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        try:
            yield self.url(name)
        finally:
            await self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextlib.asynccontextmanager
    async def empty(self) -> AsyncIterator[str]:
        """A fresh database with nothing in it (for the peers' own schemas)."""
        self.count += 1
        name = f"{self.prefix}_{self.count}"
        await self._admin(f'CREATE DATABASE "{name}"')
        try:
            yield self.url(name)
        finally:
            await self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    async def drop_template(self) -> None:
        await self._admin(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')


# --- processes --------------------------------------------------------------------------------
def service_env(url: str, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.pop("TEST_DATABASE_URL", None)
    env["DATABASE_URL"] = url
    env.update({f"TURNSTILE_{k.upper()}": v for k, v in settings.items()})
    return env


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """One `turnstile worker` process."""

    def __init__(
        self, url: str, slots: str, logs: Path, *, args: tuple[str, ...] = (), **settings: str
    ) -> None:
        self.log_path = logs
        self.log_file = logs.open("wb")
        self.process = subprocess.Popen(
            [TURNSTILE, "worker", *args],
            env=service_env(url, slots=slots, **settings),
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def peak_rss_mb(self) -> float | None:
        return peak_rss_mb(self.process.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid) or 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()


async def wait_workers(conn: asyncpg.Connection, count: int, workers: list[Worker]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited: {worker.log_path.read_text(errors='replace')[-2000:]}"
                )
        registered = await conn.fetchval(
            "SELECT count(*) FROM workers WHERE role = 'worker' AND stopped_at IS NULL"
        )
        if registered >= count:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("worker processes did not register within 60 s")


async def wait_count(conn: asyncpg.Connection, sql: str, target: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await conn.fetchval(sql) >= target:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not reached within {within:g} s: {sql}")


async def enqueue_bulk(
    queue: Queue, count: int, input_: dict[str, Any], priority: int, chunk: int = 2000
) -> None:
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        await queue.enqueue_many(
            tenant_id="bench", principal="bench", runs=[("scripted", input_, priority, None)] * n
        )


async def retrying(label: str, phase: Callable[[], Awaitable[T]]) -> T:
    """Run a phase again (from a fresh database) when the server refused a connection because
    its max_connections were taken (a shared server, other suites running): a figure is either
    measured whole or not at all."""
    for attempt in range(1, 6):
        try:
            return await phase()
        except Exception as exc:
            if "too many clients" not in str(exc) or attempt == 5:
                raise
            log(f"{label}: the server has no free connection; again in 20 s ({attempt}/5)")
            await asyncio.sleep(20)
    raise AssertionError("unreachable")


async def endpoint_stats(port: int) -> dict[str, Any]:
    """The figures a bench's loopback model endpoint keeps (`GET /stats`: bench/fake_model.py,
    bench/limited_model.py), read over a plain HTTP/1.1 request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /stats HTTP/1.1\r\nHost: bench\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        stats: dict[str, Any] = json.loads(await reader.readexactly(length))
        return stats
    finally:
        writer.close()
