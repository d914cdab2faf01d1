"""Pruning: expired idempotency keys, and finished runs past retention with everything they
own. Both delete in batches, so no statement holds many row locks for long; an undismissed
failed run (the dead letter) is never pruned."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.maintenance.service import MaintenanceService
from app.queue.core import Queue


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
