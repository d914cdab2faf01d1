"""Queue metrics from the database (depth, oldest eligible age, stuck runs, the live slots per
class and the classes no live process serves, the NOTIFY queue's fill level, running and queued
runs of the busiest tenants with the rest as `other`, the model budgets' figures), computed by
one process at a time into that process's gauges."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from app.maintenance.service import MaintenanceService
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.model_budgets import ModelBudgets
from app.queue.reads import STUCK_REASONS, Reads, coverage_of
from app.queue.tenant_limits import TOP_TENANTS, Tenants
from app.vocabulary.statuses import ACTIVE

OTHER_TENANTS = "other"
"""The tenant label of every tenant beyond the busiest ones, summed."""


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
        top_tenants: int = TOP_TENANTS,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.metrics = metrics
        self.top_tenants = top_tenants
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
        await self._tenant_runs()
        await self._model_budgets()

    async def _model_budgets(self) -> None:
        """Each endpoint's figures (at most 200 endpoints: budgets are per model, not per
        tenant), and each tenant's on it: what its calls used and hold now, its waits and its
        limits (at most 1000 pairs, the largest users and holders first)."""
        budgets = await ModelBudgets(self.queue).budgets()
        now = self.queue.clock() or datetime.now(UTC)
        for gauge in (
            self.metrics.model_requests,
            self.metrics.model_tokens,
            self.metrics.model_capacity_waits,
            self.metrics.model_pauses,
            self.metrics.model_paused,
            self.metrics.model_tenant_requests,
            self.metrics.model_tenant_tokens,
            self.metrics.model_tenant_waits,
            self.metrics.model_tenant_limit,
        ):
            gauge.clear()
        for budget in budgets:
            key = budget.endpoint
            self.metrics.model_requests.labels(key, "used").set(budget.requests_used)
            self.metrics.model_requests.labels(key, "reserved").set(budget.reservations)
            self.metrics.model_tokens.labels(key, "used").set(budget.tokens_used)
            self.metrics.model_tokens.labels(key, "reserved").set(budget.reserved_tokens)
            self.metrics.model_requests.labels(key, "booked").set(budget.booked)
            self.metrics.model_tokens.labels(key, "booked").set(budget.booked_tokens)
            for hold in budget.tenants:
                requests = self.metrics.model_tenant_requests
                tokens = self.metrics.model_tenant_tokens
                tenant = hold.tenant_id
                requests.labels(key, tenant, "used").set(hold.requests_used)
                requests.labels(key, tenant, "reserved").set(hold.reservations)
                requests.labels(key, tenant, "booked").set(hold.booked)
                requests.labels(key, tenant, "tenant_booked").set(hold.tenant_booked)
                tokens.labels(key, tenant, "used").set(hold.tokens_used)
                tokens.labels(key, tenant, "reserved").set(hold.reserved_tokens)
                tokens.labels(key, tenant, "booked").set(hold.booked_tokens)
                tokens.labels(key, tenant, "tenant_booked").set(hold.tenant_booked_tokens)
                self.metrics.model_tenant_waits.labels(key, tenant).set(hold.waits)
                for unit, limit in (
                    ("requests", hold.requests_per_minute),
                    ("tokens", hold.tokens_per_minute),
                ):
                    if limit is not None:
                        self.metrics.model_tenant_limit.labels(key, tenant, unit).set(limit)
            self.metrics.model_capacity_waits.labels(key).set(budget.waits)
            self.metrics.model_pauses.labels(key).set(budget.pauses)
            paused = budget.paused_until is not None and budget.paused_until > now
            self.metrics.model_paused.labels(key).set(1 if paused else 0)

    async def _tenant_runs(self) -> None:
        """At most `top_tenants` + 1 tenant labels: the busiest by queued runs, and `other`.
        Summed per label, so a tenant that is itself called "other" adds to the rest rather
        than hiding it."""
        depth = await Tenants(self.queue).depth(tenant_id=None, top=self.top_tenants)
        figures: dict[tuple[str, str, str], int] = {}
        for entry in depth:
            label = entry.tenant_id if entry.tenant_id is not None else OTHER_TENANTS
            for klass, counts in entry.classes.items():
                for status, value in (("running", counts.running), ("queued", counts.queued)):
                    key = (label, klass.value, status)
                    figures[key] = figures.get(key, 0) + value
        # A tenant whose work is done leaves the figures: its series go with the next tick.
        self.metrics.tenant_runs.clear()
        for (label, class_name, status), value in figures.items():
            self.metrics.tenant_runs.labels(label, class_name, status).set(value)
