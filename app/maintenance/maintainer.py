"""The one owner of a process's maintenance services: it builds them from the settings, starts
each in a task of its own, and stops them all (each handing its lease over) before the worker
pool drains. `app/main.py` holds one; tests may build services on their own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from app.config import Settings
from app.maintenance.expirer import Expirer
from app.maintenance.pruners import IdempotencyPruner, RunRetention, SessionRetention
from app.maintenance.queue_metrics import QueueMetrics
from app.maintenance.scheduler import Scheduler
from app.maintenance.service import MaintenanceService
from app.maintenance.sweeper import Sweeper
from app.maintenance.work_settler import WorkSettler
from app.observability.metrics import Metrics
from app.queue.core import Queue


class Maintainer:
    def __init__(
        self,
        queue: Queue,
        settings: Settings,
        metrics: Metrics,
        *,
        holder: str,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        # Ends runs past their deadline to start, at their deadline (woken by the process's
        # notifications through `deadline_submitted`), at least every sweep interval.
        self.expirer = Expirer(
            queue,
            holder=holder,
            interval=settings.sweep_interval_seconds,
            on_success=on_success,
        )
        self.services: list[MaintenanceService] = [
            self.expirer,
            Sweeper(
                queue,
                holder=holder,
                interval=settings.sweep_interval_seconds,
                on_success=on_success,
            ),
            # The fair walk's marks that no claim loop reaches, at the sweep's pace.
            WorkSettler(
                queue,
                holder=holder,
                interval=settings.sweep_interval_seconds,
                on_success=on_success,
            ),
            IdempotencyPruner(
                queue,
                holder=holder,
                interval=settings.prune_interval_seconds,
                on_success=on_success,
            ),
            QueueMetrics(
                queue,
                metrics,
                holder=holder,
                interval=settings.queue_metrics_interval_seconds,
                # A worker process not seen for a lease period has stopped beating: not live.
                stale_seconds=settings.lease_seconds,
                on_success=on_success,
            ),
            Scheduler(
                queue,
                holder=holder,
                interval=settings.schedule_interval_seconds,
                metrics=metrics,
                on_success=on_success,
            ),
            RunRetention(
                queue,
                holder=holder,
                interval=settings.retention_interval_seconds,
                retention_seconds=settings.retention_seconds,
                on_success=on_success,
            ),
            SessionRetention(
                queue,
                holder=holder,
                interval=settings.retention_interval_seconds,
                retention_seconds=settings.session_retention_seconds,
                on_success=on_success,
            ),
        ]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(service.run(), name=f"turnstile-{service.name}")
                for service in self.services
            ]

    async def stop(self) -> None:
        """Stop every service and wait for its loop; safe to call more than once."""
        for service in self.services:
            await service.stop()
        await asyncio.gather(*self._tasks)
