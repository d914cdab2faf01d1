"""The two long-running roles as functions: `serve(settings)`, the HTTP service (uvicorn with
the app and, unless told otherwise, its worker pool), and `run_worker(settings, ...)`, a worker
pool and the maintenance services with no HTTP server. `turnstile serve` and `turnstile worker`
call them; a Python program that runs its own workers calls `run_worker` (README, "Embedding").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from sqlalchemy.exc import DBAPIError

from app.api.connections import head_deadline_protocol
from app.config import Settings
from app.main import create_app, services
from app.store.engine import create_engine, database_place
from app.store.resolve import SchemaState, resolve_database, schema_state
from app.worker.pool import WorkerPool

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Allocations between two of the garbage collector's youngest collections in a role's process
# (Python's default: 700). A worker with thousands of runs in flight allocates fast; at the
# default, its full collections walked everything the process holds, start-up's modules and
# classes included, 170 ms each: 29 % of the worker's CPU with 2,000 runs in flight (make
# bench's in-flight phase, 2026-12-07; 8 % with start-up frozen and this threshold).
GC_FIRST_THRESHOLD = 20_000


class WorkerStartError(Exception):
    """The worker cannot start: its database stayed unreachable past
    `worker_start_timeout_seconds`, or its schema is not this version's."""


def serve(settings: Settings) -> None:
    """Serve the API (and its worker pool) until SIGINT or SIGTERM, then drain and return. A
    second SIGINT (Ctrl-C again) ends the drain's grace: what still runs is released at once."""
    app = create_app(settings)

    def pool() -> WorkerPool | None:
        state = getattr(app.state, "turnstile", None)
        return getattr(state, "pool", None)

    _server(
        server_config(settings, app),
        app.state.shutdown,
        pool=pool,
        grace_seconds=settings.drain_grace_seconds,
    ).run()


def collect_less() -> None:
    """Make the garbage collector cheap for a role's own process (`turnstile serve` and
    `turnstile worker`, not a program that embeds `run_worker`): what start-up made is frozen
    out of every collection (gc.freeze: those objects live as long as the process), and the
    youngest generation is collected every GC_FIRST_THRESHOLD allocations. Reference counting
    still frees what holds no cycle at once; cycles wait a little longer."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_FIRST_THRESHOLD, middle, oldest)


def say_draining(pool: WorkerPool | None, grace_seconds: float) -> None:
    """The one line a stop prints: what the drain waits for, and for how long at most."""
    running = len(pool.held()) if pool is not None else 0
    print(
        f"turnstile: draining: {running} runs, up to {grace_seconds:g} s (Ctrl-C again to "
        "release them now)",
        file=sys.stderr,
        flush=True,
    )


T = TypeVar("T")


def event_loop_run(main: Coroutine[Any, Any, T]) -> T:
    """Run a role's coroutine on uvloop where it is installed (a dependency everywhere but
    Windows), else on asyncio's own loop. `turnstile serve` gets the same from uvicorn."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.run(main)
    return uvloop.run(main)


def server_config(settings: Settings, app: FastAPI) -> uvicorn.Config:
    """uvicorn's settings for the service."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # our handler, installed by configure_logging
        # Forwarded headers are trusted only through TURNSTILE_TRUST_FORWARDED_HEADERS
        # (app/api/forwarded.py), never by uvicorn's default trust of a loopback proxy.
        proxy_headers=False,
        timeout_graceful_shutdown=max(1, int(settings.drain_grace_seconds) + 5),
        # Longer than the clients' own idle timeouts: the client closes first (the keep-alive
        # race, a request sent on a connection the server is closing, then cannot happen).
        timeout_keep_alive=settings.http_keep_alive_seconds,
        # A deadline for each request's head (uvicorn has none), and a cap on connections that
        # keeps the process's file descriptors for its database connections and workers.
        http=head_deadline_protocol(settings.http_header_timeout_seconds),
        limit_concurrency=settings.connection_limit,
    )


def _server(
    config: uvicorn.Config,
    shutdown: asyncio.Event,
    *,
    pool: Callable[[], WorkerPool | None] = lambda: None,
    grace_seconds: float = 0.0,
) -> uvicorn.Server:
    """uvicorn's server, telling the app the moment a stop signal arrives: uvicorn waits for
    open connections before it runs the lifespan's shutdown, so long polls and event streams
    must learn of the signal directly. The first signal says what the drain waits for; a
    second SIGINT ends the pool's grace (its runs released at once) yet still lets the
    lifespan's shutdown run, which releases them; a third is uvicorn's own forced exit."""

    class Server(uvicorn.Server):
        stops = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Signal handlers run on the event loop's thread.
            self.stops += 1
            if self.stops == 1:
                say_draining(pool(), grace_seconds)
            elif sig == signal.SIGINT and self.stops == 2:
                running = pool()
                if running is not None:
                    running.hurry()
                return  # not uvicorn's forced exit: it would skip the lifespan's release
            shutdown.set()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the signal after a graceful shutdown, so the process would die
            # of SIGTERM; a drained service exits 0 instead.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


async def run_worker(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    on_unreachable: Callable[[str, float], None] | None = None,
    on_draining: Callable[[], None] | None = None,
    on_drain: Callable[[int, float], None] | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> bool:
    """Run a worker pool and the maintenance services until `stop` is set, then drain (no new
    claims; running steps get `drain_grace_seconds`; the rest are released, attempt given back).

    Without `stop`, SIGTERM and SIGINT stop it (the process is the worker's), and a second one
    ends the drain's grace at once. `on_ready` is called with the worker's id once it claims;
    `on_unreachable(reason, retry_in)` for each failed attempt to reach the database at start
    (a fleet may start before its database), which is retried for
    `worker_start_timeout_seconds`; `on_draining()` once `stop` is set and the drain begins, and
    `on_drain(running, grace_seconds)` likewise, with what the drain waits for. `metrics_port`
    serves this process's Prometheus metrics. Returns whether the worker ran (False: stopped
    before its database answered). Raises WorkerStartError when the worker cannot start."""
    started: list[WorkerPool] = []  # the pool, once there is one
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(first: asyncio.Event = stop) -> None:
            # The first signal drains; another ends the drain's grace (runs released now).
            if not first.is_set():
                first.set()
            else:
                for pool in started:
                    pool.hurry()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal)
    schema = await _reachable_schema(settings, stop, on_unreachable)
    if stop.is_set() or schema is None:
        return False
    problem = schema.problem()
    if problem is not None:
        raise WorkerStartError(problem)
    async with services(settings, role="worker") as state:
        pool = state.pool
        assert pool is not None
        started.append(pool)
        exporter = None
        if metrics_port is not None:
            from prometheus_client import start_http_server

            # This process's own registry: no multiprocess directory, nothing shared.
            exporter, _ = start_http_server(
                metrics_port, addr=metrics_host, registry=state.metrics.registry
            )
        if on_ready is not None:
            on_ready(pool.worker_id)
        try:
            await stop.wait()
        finally:
            if exporter is not None:
                exporter.shutdown()
        if on_draining is not None:
            on_draining()
        if on_drain is not None:
            on_drain(len(pool.held()), settings.drain_grace_seconds)
    return True


async def _reachable_schema(
    settings: Settings,
    stop: asyncio.Event,
    on_unreachable: Callable[[str, float], None] | None,
) -> SchemaState | None:
    """Where the schema stands, once the database answers, retrying with backoff until
    `worker_start_timeout_seconds` have passed or `stop` is set (None then)."""
    deadline = time.monotonic() + settings.worker_start_timeout_seconds
    delay = 0.5
    while True:
        database = await asyncio.to_thread(resolve_database, settings)
        engine = create_engine(settings, database.url, pool_size=2)
        try:
            return await schema_state(engine)
        except (OSError, DBAPIError) as exc:
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
            if time.monotonic() + delay > deadline:
                raise WorkerStartError(
                    f"database unreachable at {database_place(database.url)}: {reason}"
                ) from None
            if on_unreachable is not None:
                on_unreachable(reason, delay)
        finally:
            await engine.dispose()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)
        if stop.is_set():
            return None
        delay = min(delay * 2, 10.0)
