"""What the service's own housekeeping needs from the database, as typed calls: the worker
registry (each process registers, refreshes its row with its heartbeats, and marks itself
stopped), the maintenance leases (one holder of each service at a time), the prunes of expired
idempotency keys, of finished sessionless runs past retention and of sessions idle past
theirs, the clearing of stale has_work flags of tenants' counts, and the NOTIFY queue's fill
level. The worker pool and app/maintenance call these; the statements are in
app/store/sql/workers.sql. Each takes the queue (anything with an engine and a clock) as it is
built, so its callers never hold a connection."""

from __future__ import annotations

from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.database import Clock
from app.store.statements import q


class Bound(Protocol):
    """What the store's typed calls need of their caller's queue: its engine and its clock."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def clock(self) -> Clock: ...


class WorkerRegistry:
    """The `workers` table: one row per process that ever ran a pool, API-only ones included."""

    def __init__(self, queue: Bound) -> None:
        self.queue = queue

    async def register(
        self, worker_id: str, *, host: str, pid: int, role: str, slot_groups: str
    ) -> None:
        async with self.queue.engine.begin() as conn:
            await conn.execute(
                q("register_worker"),
                {
                    "id": worker_id,
                    "host": host,
                    "pid": pid,
                    "role": role,
                    "slot_groups": slot_groups,
                    "now": self.queue.clock(),
                },
            )

    async def touch(self, worker_id: str, *, slot_groups: str) -> None:
        async with self.queue.engine.begin() as conn:
            await conn.execute(
                q("touch_worker"),
                {"id": worker_id, "slot_groups": slot_groups, "now": self.queue.clock()},
            )

    async def deregister(self, worker_id: str) -> None:
        async with self.queue.engine.begin() as conn:
            await conn.execute(q("deregister_worker"), {"id": worker_id, "now": self.queue.clock()})


class Housekeeping:
    """Maintenance leases and the prunes; each call is a transaction of its own."""

    def __init__(self, queue: Bound) -> None:
        self.queue = queue

    async def _rowcount(self, statement: str, **params: object) -> int:
        async with self.queue.engine.begin() as conn:
            result = await conn.execute(q(statement), {"now": self.queue.clock(), **params})
            return int(result.rowcount)

    async def acquire(self, name: str, holder: str, *, ttl_seconds: float) -> bool:
        """Take or renew the lease of service `name`; False while another holder has it."""
        async with self.queue.engine.begin() as conn:
            taken = await conn.execute(
                q("maintenance_acquire"),
                {
                    "name": name,
                    "holder": holder,
                    "ttl_seconds": ttl_seconds,
                    "now": self.queue.clock(),
                },
            )
            return taken.first() is not None

    async def succeeded(self, name: str, holder: str) -> None:
        await self._rowcount("maintenance_succeeded", name=name, holder=holder)

    async def release(self, name: str, holder: str) -> None:
        await self._rowcount("maintenance_release", name=name, holder=holder)

    async def prune_idempotency_keys(self, *, limit: int) -> int:
        """Delete up to `limit` expired keys; how many were deleted."""
        return await self._rowcount("prune_idempotency_keys", limit=limit)

    async def settle_idle_work(self, *, limit: int) -> tuple[int, int]:
        """Offer up to `limit` pairs marked as having work but with none to claim now to
        turnstile_settle_work (docs/adr/0009); (offered, cleared)."""
        async with self.queue.engine.begin() as conn:
            row = (
                await conn.execute(
                    q("settle_idle_work"), {"limit": limit, "now": self.queue.clock()}
                )
            ).one()
            return int(row.offered), int(row.cleared)

    async def prune_finished_runs(self, *, retention_seconds: float, limit: int) -> int:
        """Delete up to `limit` finished runs past retention (never an undismissed failure)."""
        return await self._rowcount(
            "prune_finished_runs", retention_seconds=retention_seconds, limit=limit
        )

    async def prune_idle_sessions(self, *, retention_seconds: float, limit: int) -> tuple[int, int]:
        """Delete up to `limit` sessions idle past retention, whole; (sessions, runs) deleted."""
        async with self.queue.engine.begin() as conn:
            row = (
                await conn.execute(
                    q("prune_idle_sessions"),
                    {
                        "now": self.queue.clock(),
                        "retention_seconds": retention_seconds,
                        "limit": limit,
                    },
                )
            ).one()
            return int(row.sessions), int(row.runs)

    async def notification_queue_usage(self) -> float:
        async with self.queue.engine.connect() as conn:
            return float((await conn.execute(q("notification_queue_usage"))).scalar_one())
