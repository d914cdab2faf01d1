"""The maintenance loop and its services.

`MaintenanceService` owns the lease row of its name: each tick it takes or renews the lease
(valid for a few intervals), runs `run_once()` only while it holds it, records the time of its
last successful tick, logs and carries on after a failed one, and gives the lease up on
`stop()`. A crashed holder stops renewing, its lease expires, and another process takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.observability.metrics import Metrics
from app.queue.classes import PriorityClass
from app.queue.core import Queue
from app.queue.models import SweepReport
from app.queue.sql import q

log = logging.getLogger("turnstile.maintenance")


class MaintenanceService:
    name = "maintenance"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        if interval < 0:
            raise ValueError(f"{self.name} interval must be >= 0")
        self.queue = queue
        self.holder = holder
        self.interval = interval
        # Long enough to survive a slow tick or two, short enough to fail over promptly.
        self.lease_seconds = max(3 * interval, 5.0)
        self._stopping = asyncio.Event()
        self.ticks = 0  # ticks this instance ran while holding the lease
        self.on_success = on_success

    async def run_once(self) -> Any:
        raise NotImplementedError

    async def _execute(self, name: str, params: dict[str, Any]) -> list[Any]:
        async with self.queue.engine.begin() as conn:
            result = await conn.execute(q(name), {"now": self.queue.clock(), **params})
            return list(result.all()) if result.returns_rows else [result.rowcount]

    async def acquire(self) -> bool:
        rows = await self._execute(
            "maintenance_acquire",
            {"name": self.name, "holder": self.holder, "ttl_seconds": self.lease_seconds},
        )
        return bool(rows)

    async def tick(self) -> bool:
        """One round: run if this instance holds the lease. True when it ran."""
        if not await self.acquire():
            return False
        await self.run_once()
        await self._execute("maintenance_succeeded", {"name": self.name, "holder": self.holder})
        self.ticks += 1
        if self.on_success is not None:
            self.on_success(self.name)
        return True

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
            except Exception:
                # A bad tick (database restarting, a timeout) must not end the service.
                log.exception("maintenance tick failed", extra={"service": self.name})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.interval or 0.01)

    async def stop(self) -> None:
        """Stop ticking and hand the lease over at once; safe to call more than once."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(Exception):
            await self._execute("maintenance_release", {"name": self.name, "holder": self.holder})


@dataclass(frozen=True)
class Pruned:
    deleted: int


class IdempotencyPruner(MaintenanceService):
    """Deletes expired idempotency keys in batches (an expired key already counts as absent)."""

    name = "idempotency-pruner"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        batch: int = 1000,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.batch = batch

    async def run_once(self) -> Pruned:
        deleted = 0
        while True:
            (count,) = await self._execute("prune_idempotency_keys", {"limit": self.batch})
            deleted += int(count)
            if count < self.batch:
                return Pruned(deleted)


class RunRetention(MaintenanceService):
    """Deletes finished runs older than the retention period, with everything they own, in
    batches; failed runs stay until an operator dismisses them."""

    name = "run-retention"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        retention_seconds: float,
        batch: int = 500,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.retention_seconds = retention_seconds
        self.batch = batch

    async def run_once(self) -> Pruned:
        deleted = 0
        while True:
            (count,) = await self._execute(
                "prune_finished_runs",
                {"retention_seconds": self.retention_seconds, "limit": self.batch},
            )
            deleted += int(count)
            if count < self.batch:
                return Pruned(deleted)


class QueueMetrics(MaintenanceService):
    """Computes queue depth, oldest eligible age and stuck-run counts from the database, in one
    process at a time, into that process's gauges."""

    name = "queue-metrics"

    def __init__(
        self,
        queue: Queue,
        metrics: Metrics,
        *,
        holder: str,
        interval: float,
        queued_seconds: float = 300,
        waiting_seconds: float = 86_400,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.metrics = metrics
        self.queued_seconds = queued_seconds
        self.waiting_seconds = waiting_seconds

    async def run_once(self) -> None:
        depth = await self._execute("queue_depth", {"tenant_id": None})
        stuck = await self._execute(
            "stuck_runs",
            {
                "tenant_id": None,
                "queued_seconds": self.queued_seconds,
                "waiting_seconds": self.waiting_seconds,
                "limit": 10_000,
            },
        )
        names = [klass.value for klass in PriorityClass]
        self.metrics.queue_depth.clear()
        self.metrics.oldest_age.clear()
        self.metrics.stuck.clear()
        for klass in names:
            for status in ("queued", "running", "waiting_for_user"):
                self.metrics.queue_depth.labels(klass, status).set(0)
        for row in depth:
            klass = names[int(row.class_index)]
            self.metrics.queue_depth.labels(klass, row.status).set(int(row.runs))
            if row.oldest_eligible_age is not None:
                self.metrics.oldest_age.labels(klass).set(float(row.oldest_eligible_age))
        counts = {"lease_expired": 0, "queued_too_long": 0, "waiting_too_long": 0}
        for row in stuck:
            counts[row.reason] += 1
        for reason, count in counts.items():
            self.metrics.stuck.labels(reason).set(count)
        (usage,) = await self._execute("notification_queue_usage", {})
        self.metrics.notification_queue_usage.set(float(usage.usage))


class LeasedSweeper(MaintenanceService):
    """The sweeper as a maintenance service: requeues or dead-letters expired leases, run by
    one process at a time. (The sweep itself is safe to run concurrently, SKIP LOCKED; the
    lease only saves the duplicate scans.)"""

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
        self.batch = batch

    async def run_once(self) -> SweepReport:
        return await self.queue.sweep(limit=self.batch)
