"""LISTEN on the `turnstile` channel and fan notifications out to the pool and the API.

One dedicated asyncpg connection per process (never a pooled one: a pooled connection goes
back to the pool and stops listening, and PgBouncer in transaction mode cannot hold a LISTEN).
When the connection drops it is re-established with backoff, and every subscriber is woken
once, since notifications sent while nobody listened are lost; polling stays the fallback.
With a multi-host DATABASE_URL the connection is made to whichever host takes writes (the
URL's `target_session_attrs`, app/store/engine.py), so after a failover it listens again on the
new primary: NOTIFY is sent where the queue writes, and a standby never delivers one.

Payloads are JSON written by the queue's statements (app/store/sql/runs.sql), bounded whatever
the number of rows: `{"work": [priority, ...]}` when runs became claimable,
`{"runs": ["<run id prefix>", ...]}` (the first 8 characters of at most 500 ids) when runs
changed status, `{"sessions": ["<session id prefix>"]}` when a session got a new run (its
streams, held by whichever API process, look again: migration 0013), and `"more": true` when
more runs changed than the payload names, which subscribers take as "anything may have
changed", and `"start_before": "<time>"` when a new run has a deadline to start (the expirer
wakes if it is sooner than the one it waits for: docs/start-deadlines.md).

With `listen_deltas` (API processes, which hold streams), the same connection also listens on
`turnstile_deltas` (live output, docs/adr/0007-live-output-deltas.md) and hands each
notification's deltas to the `on_deltas` subscribers; worker-only processes do not listen there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg

from app.store.engine import connect_timeout, plain_url
from app.store.primary import LOST_PRIMARY
from app.vocabulary.live_deltas import CHANNEL as DELTA_CHANNEL
from app.vocabulary.live_deltas import Delta, unpack

log = logging.getLogger("turnstile.notifier")

CHANNEL = "turnstile"
WorkCallback = Callable[[set[int] | None], None]  # None: "anything may have changed"
RunsCallback = Callable[[set[str] | None], None]  # run id prefixes; None: "look at everything"
DeltasCallback = Callable[[list[Delta]], None]
SessionsCallback = Callable[[set[str] | None], None]  # session id prefixes; None: all of them
DeadlineCallback = Callable[[datetime], None]  # a new run's deadline to start


class Notifier:
    def __init__(
        self,
        url: str,
        *,
        reconnect_min_seconds: float = 0.05,
        reconnect_max_seconds: float = 5.0,
        keepalive_seconds: float = 10.0,
        application_name: str = "turnstile listen",
        listen_deltas: bool = False,
    ) -> None:
        self.url = plain_url(url)
        self.connect_timeout = connect_timeout(url)
        self.application_name = application_name
        self.reconnect_min = reconnect_min_seconds
        self.reconnect_max = reconnect_max_seconds
        self.keepalive = keepalive_seconds
        self._work: list[WorkCallback] = []
        self._runs: list[RunsCallback] = []
        self._deltas: list[DeltasCallback] = []
        self._sessions: list[SessionsCallback] = []
        self._deadlines: list[DeadlineCallback] = []
        self.listen_deltas = listen_deltas
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._lost = asyncio.Event()
        self.connected = asyncio.Event()
        self.backend_pid: int | None = None
        self.connections = 0  # how many times a LISTEN connection was established

    def on_work(self, callback: WorkCallback) -> None:
        self._work.append(callback)

    def on_runs(self, callback: RunsCallback) -> None:
        self._runs.append(callback)

    def on_deltas(self, callback: DeltasCallback) -> None:
        self._deltas.append(callback)

    def on_sessions(self, callback: SessionsCallback) -> None:
        self._sessions.append(callback)

    def on_deadlines(self, callback: DeadlineCallback) -> None:
        self._deadlines.append(callback)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="turnstile-notifier")

    async def stop(self) -> None:
        self._stopping.set()
        self._lost.set()
        if self._task is not None:
            await self._task
            self._task = None

    # --- internals ----------------------------------------------------------------------------
    def _dispatch(self, payload: str) -> None:
        try:
            message: dict[str, Any] = json.loads(payload)
        except ValueError:
            log.warning("ignoring a malformed notification", extra={"payload": payload[:200]})
            return
        work = message.get("work")
        if work:
            priorities = {int(p) for p in work}
            for callback in self._work:
                callback(priorities)
        runs = message.get("runs")
        if message.get("more"):
            for runs_callback in self._runs:
                runs_callback(None)
        elif runs:
            prefixes = {str(prefix) for prefix in runs}
            for runs_callback in self._runs:
                runs_callback(prefixes)
        sessions = message.get("sessions")
        if sessions:
            named = {str(prefix) for prefix in sessions}
            for sessions_callback in self._sessions:
                sessions_callback(named)
        start_before = message.get("start_before")
        if start_before and self._deadlines:
            try:
                at = datetime.fromisoformat(str(start_before))
            except ValueError:
                return
            for deadline_callback in self._deadlines:
                deadline_callback(at)

    def _wake_everyone(self) -> None:
        for callback in self._work:
            callback(None)
        for runs_callback in self._runs:
            runs_callback(None)
        for sessions_callback in self._sessions:
            sessions_callback(None)

    def _on_notification(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self._dispatch(payload)

    def _on_deltas(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        deltas = unpack(payload)
        if deltas:
            for callback in self._deltas:
                callback(deltas)

    def _on_termination(self, _conn: object) -> None:
        self._lost.set()

    async def _run(self) -> None:
        delay = self.reconnect_min
        while not self._stopping.is_set():
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(
                    self.url,
                    timeout=self.connect_timeout,
                    # Always a direct connection (never PgBouncer): startup parameters pass.
                    server_settings={"application_name": self.application_name},
                )
                conn.add_termination_listener(self._on_termination)
                await conn.add_listener(CHANNEL, self._on_notification)
                if self.listen_deltas:
                    await conn.add_listener(DELTA_CHANNEL, self._on_deltas)
                self.backend_pid = conn.get_server_pid()
                self.connections += 1
                self._lost.clear()
                self.connected.set()
                delay = self.reconnect_min
                # Anything sent while we were not listening is lost: let everyone look again.
                self._wake_everyone()
                while not self._stopping.is_set() and not self._lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._lost.wait(), timeout=self.keepalive)
                    if not self._lost.is_set() and not self._stopping.is_set():
                        # A half-open TCP connection never reports itself; a query does.
                        await conn.execute("SELECT 1", timeout=self.keepalive)
            except LOST_PRIMARY as exc:
                if not self._stopping.is_set():
                    log.warning(
                        "LISTEN connection lost; reconnecting",
                        extra={"error": repr(exc), "retry_in": delay},
                    )
            finally:
                self.connected.clear()
                self.backend_pid = None
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=2)
            if self._stopping.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay)
            delay = min(delay * 2, self.reconnect_max)
