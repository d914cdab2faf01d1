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
from app.queue.core import Queue
from app.queue.housekeeping import Housekeeping
from app.queue.models import SweepReport
from app.queue.reads import STUCK_REASONS, Reads
from app.queue.statuses import ACTIVE

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
        self.housekeeping = Housekeeping(queue)
        self.holder = holder
        self.interval = interval
        # Long enough to survive a slow tick or two, short enough to fail over promptly.
        self.lease_seconds = max(3 * interval, 5.0)
        self._stopping = asyncio.Event()
        self.ticks = 0  # ticks this instance ran while holding the lease
        self.on_success = on_success

    async def run_once(self) -> Any:
        raise NotImplementedError

    async def acquire(self) -> bool:
        return await self.housekeeping.acquire(
            self.name, self.holder, ttl_seconds=self.lease_seconds
        )

    async def tick(self) -> bool:
        """One round: run if this instance holds the lease. True when it ran."""
        if not await self.acquire():
            return False
        await self.run_once()
        await self.housekeeping.succeeded(self.name, self.holder)
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
            await self.housekeeping.release(self.name, self.holder)


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
            count = await self.housekeeping.prune_idempotency_keys(limit=self.batch)
            deleted += count
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
            count = await self.housekeeping.prune_finished_runs(
                retention_seconds=self.retention_seconds, limit=self.batch
            )
            deleted += count
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
        reads = Reads(self.queue)
        depth = await reads.depth(tenant_id=None)
        stuck = await reads.stuck(
            tenant_id=None,
            queued_seconds=self.queued_seconds,
            waiting_seconds=self.waiting_seconds,
            limit=10_000,
        )
        self.metrics.queue_depth.clear()
        self.metrics.oldest_age.clear()
        self.metrics.stuck.clear()
        for klass, entry in depth.items():
            for status in ACTIVE:
                self.metrics.queue_depth.labels(klass.value, status).set(getattr(entry, status))
            if entry.oldest_eligible_age_seconds is not None:
                self.metrics.oldest_age.labels(klass.value).set(entry.oldest_eligible_age_seconds)
        counts = dict.fromkeys(STUCK_REASONS, 0)
        for item in stuck:
            counts[item.reason] += 1
        for reason, count in counts.items():
            self.metrics.stuck.labels(reason).set(count)
        usage = await self.housekeeping.notification_queue_usage()
        self.metrics.notification_queue_usage.set(usage)


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
