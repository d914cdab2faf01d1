"""The work-flag clearer: clears `has_work` on tenants' count rows that have nothing queued any
more but were not cleared by the statement that emptied them (docs/adr/0006, "Striped queued
counts"). A stale flag costs every fair claim's walk one probe of that tenant until it is
cleared; it never hides work, so this service bounds a cost, not a correctness risk."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from app.maintenance.service import MaintenanceService
from app.queue.core import Queue

log = logging.getLogger("turnstile.work_flags")


@dataclass(frozen=True)
class FlagsCleared:
    offered: int
    cleared: int


class WorkFlagClearer(MaintenanceService):
    """Offers flagged, apparently empty count rows to turnstile_clear_work in batches."""

    name = "work-flag-clearer"

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
            raise ValueError("work-flag clearer batch must be >= 1")
        self.batch = batch

    async def run_once(self) -> FlagsCleared:
        offered, cleared = await self.housekeeping.clear_idle_work(limit=self.batch)
        if cleared:
            log.info("cleared %d stale work flags of %d offered", cleared, offered)
        return FlagsCleared(offered, cleared)
