"""Queue metrics from the database (depth, oldest eligible age, stuck runs, the live slots per
class and the classes no live process serves, the NOTIFY queue's fill level), computed by one
process at a time into that process's gauges."""

from __future__ import annotations

from collections.abc import Callable

from app.maintenance.service import MaintenanceService
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.reads import STUCK_REASONS, Reads, coverage_of
from app.queue.statuses import ACTIVE


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
        stale_seconds: float = 30,
        queued_seconds: float = 300,
        waiting_seconds: float = 86_400,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.metrics = metrics
        self.stale_seconds = stale_seconds
        self.queued_seconds = queued_seconds
        self.waiting_seconds = waiting_seconds

    async def run_once(self) -> None:
        reads = Reads(self.queue)
        depth = await reads.depth(tenant_id=None)
        live_slots = await reads.live_slots(stale_seconds=self.stale_seconds)
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
        for klass, slots in live_slots.items():
            self.metrics.live_slots.labels(klass.value).set(slots)
            unserved = coverage_of(depth[klass], slots).unserved
            self.metrics.unserved.labels(klass.value).set(1 if unserved else 0)
        counts = dict.fromkeys(STUCK_REASONS, 0)
        for item in stuck:
            counts[item.reason] += 1
        for reason, count in counts.items():
            self.metrics.stuck.labels(reason).set(count)
        usage = await self.housekeeping.notification_queue_usage()
        self.metrics.notification_queue_usage.set(usage)
