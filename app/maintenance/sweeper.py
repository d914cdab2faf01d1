"""The sweeper (ADR-0004 decisions 3 and 5): requeues runs whose lease expired, with backoff,
and dead-letters those that used their last attempt (`Queue.sweep`). The one sweeper: the race
gate and the core tests run this class, as production does."""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.maintenance.service import MaintenanceService
from app.queue.core import Queue
from app.vocabulary.records import SweepReport

log = logging.getLogger("turnstile.sweeper")


class Sweeper(MaintenanceService):
    """Requeues or dead-letters expired leases, run by one process at a time. (The sweep itself
    is safe to run concurrently, SKIP LOCKED; the lease only saves the duplicate scans.)"""

    name = "sweeper"

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
        if batch < 1:
            raise ValueError("sweeper batch must be >= 1")
        self.batch = batch

    async def run_once(self) -> SweepReport:
        report = await self.queue.sweep(limit=self.batch)
        # Interrupts past their bound, and pending turns left without an active run.
        turns = await self.queue.sweep_turns(limit=self.batch)
        if turns:
            log.info("swept turns", extra={"turns": turns})
        if report.requeued or report.failed:
            log.info(
                "swept expired leases",
                extra={"requeued": report.requeued, "failed": report.failed},
            )
        return report
