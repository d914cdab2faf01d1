"""The expirer (docs/start-deadlines.md): ends every queued run never claimed whose deadline to
start has passed, cancelled with reason `expired` (`Queue.expire_overdue`), at its deadline.

Unlike the other services it does not wait a fixed interval: holding its lease, it sleeps until
the earliest deadline of a queued run (`Queue.next_start_deadline`), at most `interval` (so the
lease is renewed and a new holder takes over within a few intervals), and a notification naming
a sooner deadline (`deadline_submitted`, fed by the process's LISTEN connection) wakes it early.
A process that does not hold the lease ignores those and looks again every `interval`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from app.maintenance.service import MaintenanceService
from app.queue.core import Queue

log = logging.getLogger("turnstile.expirer")

MIN_DELAY_SECONDS = 0.02


class Expirer(MaintenanceService):
    name = "expirer"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        batch: int = 500,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        if interval <= 0:
            raise ValueError("expirer interval must be > 0")
        if batch < 1:
            raise ValueError("expirer batch must be >= 1")
        self.batch = batch
        self._wake = asyncio.Event()
        self._holding = False  # whether the last tick held the lease
        # When the loop means to look next (None: it is looking now).
        self._due: datetime | None = None

    async def run_once(self) -> int:
        expired = await self.queue.expire_overdue(limit=self.batch)
        if expired:
            log.info("expired runs past their deadline to start", extra={"expired": len(expired)})
        return len(expired)

    def deadline_submitted(self, at: datetime) -> None:
        """A new run's deadline to start (from its notification): wake the loop when it is
        sooner than the time the loop means to look next, or the loop is looking now (what
        it reads may have missed the run)."""
        if self._holding and (self._due is None or at < self._due):
            self._wake.set()

    def _now(self) -> datetime:
        return self.queue.clock() or datetime.now(UTC)

    async def _delay(self) -> float:
        """How long to sleep: until the earliest deadline, at most `interval`."""
        seconds = await self.queue.next_start_deadline()
        if seconds is None:
            return self.interval
        # A floor, so a deadline passed that nothing could expire (its row locked by a claim
        # about to commit) is looked at again soon, not in a busy loop.
        return min(max(seconds, MIN_DELAY_SECONDS), self.interval)

    async def run(self) -> None:
        while not self._stopping.is_set():
            # Cleared before looking: a deadline notified while this looks wakes the wait.
            self._wake.clear()
            self._due = None
            delay = self.interval
            try:
                self._holding = await self.tick()
                if self._holding:
                    delay = await self._delay()
                    self._due = self._now() + timedelta(seconds=delay)
            except Exception:
                # A bad tick (database restarting, a timeout) must not end the service.
                log.exception("maintenance tick failed", extra={"service": self.name})
            wake = asyncio.create_task(self._wake.wait())
            stop = asyncio.create_task(self._stopping.wait())
            try:
                await asyncio.wait({wake, stop}, timeout=delay, return_when="FIRST_COMPLETED")
            finally:
                for task in (wake, stop):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
