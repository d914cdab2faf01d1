"""The sweeper: a maintenance service that requeues runs whose lease expired, with backoff,
and dead-letters those that used their last attempt (ADR-0004 decisions 3 and 5).

`run_once()` is what tests call; `run()` repeats it every `interval` seconds (0 means
back-to-back, which the race-gate test uses), logs a failed tick and carries on. `stop()` is
idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from app.queue.core import Queue
from app.queue.models import SweepReport

log = logging.getLogger("turnstile.sweeper")


class Sweeper:
    name = "sweeper"

    def __init__(
        self,
        queue: Queue,
        *,
        interval: float = 5.0,
        batch: int = 500,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        if interval < 0:
            raise ValueError("sweeper interval must be >= 0")
        if batch < 1:
            raise ValueError("sweeper batch must be >= 1")
        self.queue = queue
        self.interval = interval
        self.batch = batch
        self._stopping = asyncio.Event()
        self.last_report: SweepReport | None = None
        self.on_success = on_success

    async def run_once(self) -> SweepReport:
        report = await self.queue.sweep(limit=self.batch)
        self.last_report = report
        if self.on_success is not None:
            self.on_success(self.name)
        if report.requeued or report.failed:
            log.info(
                "swept expired leases",
                extra={"requeued": report.requeued, "failed": report.failed},
            )
        return report

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except Exception:
                # A bad tick (database restarting, a timeout) must not end the service.
                log.exception("sweeper tick failed; retrying at the next interval")
            if self.interval == 0:
                await asyncio.sleep(0)  # yield, so a zero interval cannot starve the loop
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.interval)

    def stop(self) -> None:
        self._stopping.set()
