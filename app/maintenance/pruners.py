"""Pruning: expired idempotency keys; finished sessionless runs past retention with everything
they own; and sessions idle past their own retention, whole (a session's runs are its
transcript, kept while it is active). All delete in batches, so no statement holds many row
locks for long; an undismissed failed run (the dead letter) is never pruned."""

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
    """Deletes finished sessionless runs older than the retention period, with everything they
    own, in batches; failed runs stay until an operator dismisses them. Runs of a session go
    with their session (`SessionRetention`)."""

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


@dataclass(frozen=True)
class SessionsPruned:
    sessions: int
    runs: int


class SessionRetention(MaintenanceService):
    """Deletes sessions idle longer than their retention period, whole (runs, events, inputs,
    checkpoints, journal), in batches. A session is idle when no turn reached it, no run of it
    finished or was dismissed since the cutoff, none is active and none is an undismissed
    failure."""

    name = "session-retention"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        retention_seconds: float,
        batch: int = 100,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(queue, holder=holder, interval=interval, on_success=on_success)
        self.retention_seconds = retention_seconds
        self.batch = batch

    async def run_once(self) -> SessionsPruned:
        sessions = runs = 0
        while True:
            gone, their_runs = await self.housekeeping.prune_idle_sessions(
                retention_seconds=self.retention_seconds, limit=self.batch
            )
            sessions += gone
            runs += their_runs
            if gone < self.batch:
                return SessionsPruned(sessions, runs)
