"""The heartbeat thread: the leases a worker pool holds, renewed on their own timing.

Heartbeats that share the event loop and the connection pool with the work they protect fall
behind it exactly when it matters: a pool busy with 2,000 model calls ran its beats seconds
late, past the lease, and lost hundreds of runs that were executing fine (issue 41). So the
beats run in a thread of their own, with an event loop of their own and a connection of their
own (`engine`, built in the thread: the app factory's own engine of one connection, or by
default `twin_engine`, the pool's engine's URL and connection arguments), started and stopped
with the pool. The thread reads the pool's held executions, sends one statement for all of
them each interval, and:

- extends each renewed execution's trusted deadline at once (a float the executions read: no
  need to wait for the busy loop to learn it);
- hands everything else to the pool's own loop (`call_soon_threadsafe`): a lease reported lost
  cancels its execution there (the pool still fences on a lost lease), and heartbeats failing
  until a lease's deadline self-fence it there.

Its lag, how late a beat started plus how long its statement took, is measured on each beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.store.twin import twin_engine

log = logging.getLogger("turnstile.worker")

Beat = Callable[[Queue], Awaitable[None]]


class HeartbeatThread:
    def __init__(
        self,
        queue: Queue,
        beat: Beat,
        *,
        interval: float,
        on_lag: Callable[[float], None] | None = None,
        engine: Callable[[], AsyncEngine] | None = None,
    ) -> None:
        self._queue = queue
        self._engine = engine or (lambda: twin_engine(queue.engine))
        self._beat = beat
        self.interval = interval
        self._on_lag = on_lag
        self.lag = 0.0
        self.max_lag = 0.0
        self.beats = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="turnstile-heartbeat", daemon=True)
        self._thread.start()
        self._ready.wait()

    async def stop(self) -> None:
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        self._thread = None
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(thread.join)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("the heartbeat thread ended with an error")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        engine = self._engine()
        queue = Queue(engine, self._queue.config, clock=self._queue.clock)
        self._ready.set()
        try:
            due = time.monotonic() + self.interval
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._stop.wait(), timeout=max(due - time.monotonic(), 0.0)
                    )
                if self._stop.is_set():
                    return
                started = time.monotonic()
                try:
                    await self._beat(queue)
                except Exception:
                    log.warning("heartbeat round failed", exc_info=True)
                ended = time.monotonic()
                self.lag = max(started - due, 0.0) + (ended - started)
                self.max_lag = max(self.max_lag, self.lag)
                self.beats += 1
                if self._on_lag is not None:
                    self._on_lag(self.lag)
                # The next beat one interval after this one was due; never a burst to catch
                # up (one beat renews every lease).
                due = max(due + self.interval, ended)
        finally:
            await engine.dispose()
