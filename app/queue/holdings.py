"""A tenant's holdings: the schedules and webhook endpoints it keeps, which act on its behalf
without a submission (a schedule's ticks, an endpoint's deliveries).

Each is capped per tenant (TURNSTILE_TENANT_MAX_SCHEDULES, TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS,
or the tenant's own `max_schedules` and `max_webhook_endpoints`), and a schedule may fire at most
once per TURNSTILE_SCHEDULE_MIN_INTERVAL_SECONDS (or the tenant's
`min_schedule_interval_seconds`). The check runs inside the creating transaction after the
tenant's holdings lock (`lock_tenant_holdings`), so concurrent creations of one tenant count one
after the other and the cap is exact. The runs they make are limited elsewhere: ticks and
deliveries count against the tenant's running limit like any run of their class (docs/adr/0006).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.cron import CronSchedule
from app.queue.errors import HoldingLimitError, InvalidScheduleError
from app.queue.tenant_limits import LimitDefaults, TenantLimits
from app.store import tenant_rows, webhook_rows

SCHEDULES = "schedules"
WEBHOOK_ENDPOINTS = "webhook_endpoints"
TASK_PUSH_CONFIGS = "push_configurations_of_the_task"
MINUTE = 60


class Holdings:
    """The holdings' checks, on the process defaults every tenant without overrides gets."""

    def __init__(self, defaults: LimitDefaults | None = None) -> None:
        self.defaults = defaults or LimitDefaults()

    async def admit_schedule(
        self, conn: AsyncConnection, tenant_id: str, schedule: CronSchedule, now: datetime
    ) -> None:
        """Refuse a new schedule over the tenant's cap (HoldingLimitError) or firing more often
        than its minimum interval (InvalidScheduleError on `cron`). Call it in the creating
        transaction, before the insert: it holds the tenant's holdings lock to the commit."""
        held, limits = await self._holdings(conn, tenant_id)
        limit = limits.max_schedules
        if limit is not None and int(held[SCHEDULES] or 0) >= limit:
            raise HoldingLimitError(tenant_id, SCHEDULES, limit, int(held[SCHEDULES] or 0))
        minimum = limits.min_schedule_interval_seconds
        # Five fields fire at most once a minute: only a shorter minimum needs a look.
        if minimum is not None and (schedule.with_seconds or minimum > MINUTE):
            gap = schedule.shortest_gap(now, below=timedelta(seconds=minimum))
            if gap is not None and gap.total_seconds() < minimum:
                raise InvalidScheduleError(
                    "cron",
                    f"fires {gap.total_seconds():g} s apart; this tenant's schedules may fire "
                    f"at most once every {minimum} s",
                )

    async def admit_webhook_endpoint(self, conn: AsyncConnection, tenant_id: str) -> None:
        """Refuse a new endpoint over the tenant's cap (HoldingLimitError), as above."""
        held, limits = await self._holdings(conn, tenant_id)
        limit = limits.max_webhook_endpoints
        if limit is not None and int(held[WEBHOOK_ENDPOINTS] or 0) >= limit:
            raise HoldingLimitError(
                tenant_id, WEBHOOK_ENDPOINTS, limit, int(held[WEBHOOK_ENDPOINTS] or 0)
            )

    async def admit_task_push_config(
        self, conn: AsyncConnection, tenant_id: str, run_id: UUID, limit: int
    ) -> None:
        """Refuse an A2A task's push configuration past `limit` per task (HoldingLimitError).
        They are not counted among the tenant's webhook endpoints: each reports one run, and
        the run's retention bounds them. Under the tenant's holdings lock, as above."""
        await self._holdings(conn, tenant_id)  # for its lock
        held = await webhook_rows.task_push_count(conn, tenant_id=tenant_id, run_id=run_id)
        if held >= limit:
            raise HoldingLimitError(tenant_id, TASK_PUSH_CONFIGS, limit, held)

    async def _holdings(
        self, conn: AsyncConnection, tenant_id: str
    ) -> tuple[dict[str, int | None], TenantLimits]:
        """What the tenant holds, and its limits as they apply (overrides over defaults,
        merged as everywhere else by `TenantLimits.effective`)."""
        row = dict(
            await tenant_rows.holdings_row(
                conn,
                tenant_id,
                default_max_schedules=self.defaults.max_schedules,
                default_max_webhook_endpoints=self.defaults.max_webhook_endpoints,
            )
        )
        overrides = TenantLimits(
            max_schedules=row["max_schedules"],
            max_webhook_endpoints=row["max_webhook_endpoints"],
            min_schedule_interval_seconds=row["min_schedule_interval_seconds"],
        )
        return row, overrides.effective(self.defaults)
