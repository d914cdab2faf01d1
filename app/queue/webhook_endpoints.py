"""Webhook endpoints: a tenant's receivers of signed run transitions (`webhooks.sql`).

The core keeps endpoints and knows which runs are deliveries; it never sees a secret in the
clear (the caller encrypts and decrypts, app/security/secret_box.py) and never sends HTTP (the
runtime's `webhook` agent does, app/runtime/webhooks.py). Deliveries are inserted by the
transitions they report (runs.sql's `webhook_deliveries` fragment); deleting an endpoint
cancels the pending ones; `delivery_failed` counts failed deliveries in a row and disables the
endpoint at `disable_after`.

Limits: deliveries are inserted by the transition statements, never through submission, so no
per-tenant submission rate or queued-run quota applies to them, and none must: a refused
delivery would break "a committed transition always has its delivery". They run under the
tenant's running limit like any async run of theirs (fairness holds), each within its total
deadline (TURNSTILE_WEBHOOK_TIMEOUT_SECONDS), and a tenant holds at most its cap of endpoints
(TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS or its own, app/queue/holdings.py).
"""

from __future__ import annotations

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
