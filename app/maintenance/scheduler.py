"""The scheduler: the safety net that keeps every active schedule's next tick queued.

The worker pool creates a schedule's next tick when it claims the previous one
(app/queue/scheduling.py); a process that dies between the claim and that write leaves the
schedule without a tick ahead. Each round this service creates the next tick of every active
schedule that has none (the same locked, ON CONFLICT DO NOTHING path, so it can never add a
second run for a tick), then refreshes the schedule gauges. Ticks it had to create are counted:
a steady rise means the pool's own path is failing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.maintenance.service import MaintenanceService
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.scheduling import Schedules, ScheduleStats

log = logging.getLogger("turnstile.scheduler")


class Scheduler(MaintenanceService):
    """Creates missing schedule ticks and computes the schedule gauges, one process at a time."""

    name = "scheduler"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        metrics: Metrics | None = None,
        batch: int = 200,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        if batch < 1:
            raise ValueError("scheduler batch must be >= 1")
        self.schedules = Schedules(queue)
        self.metrics = metrics
        self.batch = batch

    async def run_once(self) -> ScheduleStats:
        created = await self.schedules.ensure_ticks(batch=self.batch)
        if created:
            log.info("created missing schedule ticks", extra={"created": created})
        stats = await self.schedules.stats()
        if self.metrics is not None:
            self.metrics.schedule_ticks_repaired.inc(created)
            self.metrics.schedules.labels("active").set(stats.active)
            self.metrics.schedules.labels("paused").set(stats.paused)
            self.metrics.schedules_without_tick.set(stats.without_tick)
            self.metrics.schedule_overdue.set(stats.most_overdue_seconds)
        return stats
