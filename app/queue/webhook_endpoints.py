"""Webhook endpoints: a tenant's receivers of signed run transitions (`webhooks.sql`).

The core keeps endpoints and knows which runs are deliveries; it never sees a secret in the
clear (the caller encrypts and decrypts, app/security/secret_box.py) and never sends HTTP (the
runtime's `webhook` agent does, app/runtime/webhooks.py). Deliveries are inserted by the
transitions they report (runs.sql's `webhook_deliveries` fragment); deleting an endpoint
cancels the pending ones; `delivery_failed` counts failed deliveries in a row and disables the
endpoint at `disable_after`.

An A2A task's push configuration (issue 34) is an endpoint restricted to one run (`run_id`,
format 'a2a', migration 0021): the fan-out takes it for that run's transitions only, the
delivery renders A2A's payload and headers for it (app/runtime/webhook_delivery.py), and it is
retried, dead-lettered and disabled as any endpoint. At most MAX_TASK_PUSH_CONFIGS per run,
not counted among the tenant's endpoints (its cap counts webhooks only).

Limits: deliveries are inserted by the transition statements, never through submission, so no
per-tenant submission rate or queued-run quota applies to them, and none must: a refused
delivery would break "a committed transition always has its delivery". They run under the
tenant's running limit like any async run of theirs (fairness holds), each within its total
deadline (TURNSTILE_WEBHOOK_TIMEOUT_SECONDS), and a tenant holds at most its cap of endpoints
(TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS or its own, app/queue/holdings.py).
"""

from __future__ import annotations

import builtins
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from app.queue.core import Queue
from app.queue.errors import TurnstileError
from app.queue.holdings import Holdings
from app.store import webhook_rows
from app.store.transactions import transaction

log = logging.getLogger("turnstile.webhooks")

# The built-in agent of deliveries; runs.sql spells it too ('webhook'), to exempt deliveries
# from producing deliveries and to give them their own backoff.
WEBHOOK_AGENT = "webhook"
EVENTS = ("run.succeeded", "run.failed", "run.cancelled", "run.waiting")
DELETE_BATCH = 500
"""A deleted endpoint's pending deliveries are cancelled this many at a time."""

FORMAT_STANDARD = "standard"
FORMAT_A2A = "a2a"
MAX_TASK_PUSH_CONFIGS = 10
"""An A2A task's push configurations at most (not counted among the tenant's endpoints)."""

DISABLE_AFTER = 20  # failed deliveries in a row (each after all its attempts) that disable one


@dataclass(frozen=True)
class Disabled:
    """A failed delivery just disabled its endpoint."""

    consecutive_failures: int
    disable_after: int


class WebhookNotFoundError(TurnstileError):
    def __init__(self, endpoint_id: UUID) -> None:
        super().__init__(f"webhook {endpoint_id} not found")
        self.endpoint_id = endpoint_id


@dataclass(frozen=True)
class Endpoint:
    id: UUID
    tenant_id: str
    url: str
    events: list[str]
    consecutive_failures: int
    disabled_at: datetime | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> Endpoint:
        return cls(
            id=row["id"],
            tenant_id=row["tenant_id"],
            url=row["url"],
            events=list(row["events"]),
            consecutive_failures=int(row["consecutive_failures"]),
            disabled_at=row["disabled_at"],
            created_at=row["created_at"],
        )


@dataclass(frozen=True)
class DeliveryTarget:
    """Where a delivery run sends, read when it sends (so a rotated secret applies)."""

    endpoint_id: UUID
    url: str
    secret_ciphertext: bytes
    live: bool  # neither deleted nor disabled
    format: str = FORMAT_STANDARD  # or FORMAT_A2A: the ciphertext holds the token then


class TaskPushNotFoundError(TurnstileError):
    def __init__(self, config_id: str) -> None:
        super().__init__(f"push notification configuration {config_id!r} not found")
        self.config_id = config_id


@dataclass(frozen=True)
class TaskPushConfig:
    """An A2A task's push configuration: an endpoint reporting one run (format 'a2a'); its
    ciphertext holds the token and authentication (the caller decrypts)."""

    id: UUID
    run_id: UUID
    url: str
    secret_ciphertext: bytes
    consecutive_failures: int
    disabled_at: datetime | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> TaskPushConfig:
        return cls(
            id=row["id"],
            run_id=row["run_id"],
            url=row["url"],
            secret_ciphertext=bytes(row["secret_ciphertext"]),
            consecutive_failures=int(row["consecutive_failures"]),
            disabled_at=row["disabled_at"],
            created_at=row["created_at"],
        )


class Webhooks:
    def __init__(
        self,
        queue: Queue,
        *,
        disable_after: int = DISABLE_AFTER,
        holdings: Holdings | None = None,
    ) -> None:
        self.queue = queue
        self.disable_after = disable_after
        # Without the process defaults, a tenant's own cap still applies.
        self.holdings = holdings or Holdings()

    async def create(
        self, *, tenant_id: str, principal: str, url: str, events: list[str], secret: bytes
    ) -> Endpoint:
        async with transaction(self.queue.engine) as conn:
            # The tenant's cap; it holds the tenant's holdings lock to the commit.
            await self.holdings.admit_webhook_endpoint(conn, tenant_id)
            row = await webhook_rows.insert_endpoint(
                conn,
                tenant_id=tenant_id,
                principal=principal,
                url=url,
                events=events,
                secret=secret,
            )
        return Endpoint.from_row(row)

    async def list(self, tenant_id: str | None) -> list[Endpoint]:
        """A tenant's endpoints, or every tenant's (None: the operator CLI's view)."""
        rows = await webhook_rows.endpoint_rows(self.queue.engine, tenant_id)
        return [Endpoint.from_row(row) for row in rows]

    async def rotate(self, *, tenant_id: str, endpoint_id: UUID, secret: bytes) -> None:
        found = await webhook_rows.rotate_secret(
            self.queue.engine, tenant_id=tenant_id, endpoint_id=endpoint_id, secret=secret
        )
        if not found:
            raise WebhookNotFoundError(endpoint_id)

    async def enable(self, *, tenant_id: str, endpoint_id: UUID) -> Endpoint:
        """Re-enable an endpoint (disabled after failed deliveries), its count reset."""
        row = await webhook_rows.enable_endpoint(
            self.queue.engine, tenant_id=tenant_id, endpoint_id=endpoint_id
        )
        if row is None:
            raise WebhookNotFoundError(endpoint_id)
        return Endpoint.from_row(row)

    async def disable(self, *, tenant_id: str, endpoint_id: UUID) -> Endpoint:
        """Stop deliveries to an endpoint by hand, as failed deliveries do (`enable` undoes it)."""
        row = await webhook_rows.disable_endpoint(
            self.queue.engine, tenant_id=tenant_id, endpoint_id=endpoint_id
        )
        if row is None:
            raise WebhookNotFoundError(endpoint_id)
        return Endpoint.from_row(row)

    async def delete(self, *, tenant_id: str, endpoint_id: UUID, actor: str) -> int:
        """Delete the endpoint, then cancel its pending deliveries a batch at a time (each
        batch a transaction of its own, so a backlog of any size is deleted); how many were
        cancelled. A pending delivery a crash leaves behind fails at once when it runs."""
        deleted = await webhook_rows.delete_endpoint(
            self.queue.engine, tenant_id=tenant_id, endpoint_id=endpoint_id
        )
        if not deleted:
            raise WebhookNotFoundError(endpoint_id)
        cancelled = 0
        while True:
            pending = await webhook_rows.pending_delivery_ids(
                self.queue.engine, endpoint_id, limit=DELETE_BATCH
            )
            if not pending:
                return cancelled
            cancelled += await self.queue.cancel_many(
                pending,
                actor=actor,
                reason="webhook endpoint deleted",
                tenant_id=tenant_id,
            )

    async def create_task_push(
        self, *, tenant_id: str, principal: str, run_id: UUID, url: str, secret: bytes
    ) -> TaskPushConfig:
        """A push configuration of the run (the caller has checked the run is the caller's
        and the URL passes the egress checks), within MAX_TASK_PUSH_CONFIGS per run."""
        async with transaction(self.queue.engine) as conn:
            await self.holdings.admit_task_push_config(
                conn, tenant_id, run_id, MAX_TASK_PUSH_CONFIGS
            )
            row = await webhook_rows.insert_task_push(
                conn,
                tenant_id=tenant_id,
                principal=principal,
                run_id=run_id,
                url=url,
                secret=secret,
            )
        return TaskPushConfig.from_row(row)

    async def catch_up_task_push(self, config: TaskPushConfig) -> bool:
        """For a configuration stored just after its task was created (SendMessage): the
        delivery of a transition the task made before the configuration existed (it asked or
        ended meanwhile), made once, never beside the transition's own. Whether it made one."""
        made = await webhook_rows.task_push_catch_up(
            self.queue.engine,
            run_id=config.run_id,
            endpoint_id=config.id,
            hook_attempts=self.queue.config.webhook_max_attempts,
        )
        return made > 0

    async def task_pushes(
        self, *, tenant_id: str, run_id: UUID, after: UUID | None = None, limit: int = 100
    ) -> builtins.list[TaskPushConfig]:
        rows = await webhook_rows.task_push_rows(
            self.queue.engine, tenant_id=tenant_id, run_id=run_id, after=after, limit=limit
        )
        return [TaskPushConfig.from_row(row) for row in rows]

    async def task_push(self, *, tenant_id: str, run_id: UUID, config_id: str) -> TaskPushConfig:
        try:
            wanted = UUID(config_id)
        except ValueError:
            raise TaskPushNotFoundError(config_id) from None
        row = await webhook_rows.task_push_row(
            self.queue.engine, tenant_id=tenant_id, run_id=run_id, config_id=wanted
        )
        if row is None:
            raise TaskPushNotFoundError(config_id)
        return TaskPushConfig.from_row(row)

    async def delete_task_push(
        self, *, tenant_id: str, run_id: UUID, config_id: str, actor: str
    ) -> None:
        """Delete it as an endpoint is deleted (its pending deliveries cancelled)."""
        found = await self.task_push(tenant_id=tenant_id, run_id=run_id, config_id=config_id)
        try:
            await self.delete(tenant_id=tenant_id, endpoint_id=found.id, actor=actor)
        except WebhookNotFoundError:
            raise TaskPushNotFoundError(config_id) from None

    async def target(self, delivery_run_id: UUID, endpoint_id: UUID) -> DeliveryTarget | None:
        """The endpoint a delivery run sends to, if it is of the run's tenant."""
        row = await webhook_rows.endpoint_for_delivery(
            self.queue.engine, run_id=delivery_run_id, endpoint_id=endpoint_id
        )
        if row is None:
            return None
        return DeliveryTarget(
            endpoint_id=row["id"],
            url=row["url"],
            secret_ciphertext=bytes(row["secret_ciphertext"]),
            live=row["disabled_at"] is None and row["deleted_at"] is None,
            format=str(row["format"]),
        )

    async def delivery_succeeded(self, endpoint_id: UUID) -> None:
        await webhook_rows.delivery_succeeded(self.queue.engine, endpoint_id)

    async def delivery_failed(self, endpoint_id: UUID) -> Disabled | None:
        """Count a failed delivery; what disabled the endpoint when this one did."""
        row = await webhook_rows.delivery_failed(
            self.queue.engine, endpoint_id, disable_after=self.disable_after
        )
        if row is None or not row["disabled_now"]:
            return None
        return Disabled(int(row["consecutive_failures"]), self.disable_after)
