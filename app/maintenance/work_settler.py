"""The work settler: the backstop of the fair walk's marks (docs/adr/0009).

A pair (tenant, class band) is in the fair walk while it has a queued run to claim now. A claim
takes a pair out when it walks it and finds nothing; this service takes out the idle marked
pairs no claim walks. A pair left marked only costs a walk one probe, once: this bounds a cost,
not a correctness risk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from app.maintenance.service import MaintenanceService
from app.queue.core import Queue

log = logging.getLogger("turnstile.work_settler")


@dataclass(frozen=True)
class WorkSettled:
    offered: int
    cleared: int


class WorkSettler(MaintenanceService):
    """Offers idle marked pairs to turnstile_settle_work in batches."""

    name = "work-settler"

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
            raise ValueError("work settler batch must be >= 1")
        self.batch = batch

    async def run_once(self) -> WorkSettled:
        offered, cleared = await self.housekeeping.settle_idle_work(limit=self.batch)
        if cleared:
            log.info("settled %d idle pairs of %d offered", cleared, offered)
        return WorkSettled(offered, cleared)
