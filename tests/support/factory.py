"""A run in any state, for tests: `RunFactory.make(status=..., epoch=..., attempts=...)`.

The run gets there through the queue's own statements, not raw INSERTs: every claim, requeue,
release and ending is a real transition with its event, so the run's log passes the shared
invariants and the state is one production could reach. The queue must run on a `ManualClock`,
which the factory moves past leases and backoffs (and leaves where a given lease expiry needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from app.queue.core import Queue
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import JSON, Lease, NewRun, Run, Written
from app.vocabulary.statuses import RunStatus
from tests.support.clock import ManualClock

OWNER = "factory-worker"


@dataclass(frozen=True)
class Made:
    run: Run
    lease: Lease | None  # the current hold, for a running run


class RunFactory:
    def __init__(self, queue: Queue, clock: ManualClock) -> None:
        if queue.clock is not clock:
            raise ValueError("the factory's queue must run on the factory's clock")
        self.queue = queue
        self.clock = clock

    async def make(
        self,
        status: RunStatus | str = RunStatus.QUEUED,
        *,
        epoch: int | None = None,
        attempts: int | None = None,
        lease_expires_in: float | None = None,
        klass: PriorityClass = PriorityClass.ASYNC,
        max_attempts: int = 3,
        input: JSON = None,
        tenant_id: str = "t",
        principal: str = "p",
        session_id: UUID | None = None,
    ) -> Made:
        """A run in `status`. For running (and the statuses reached from it): `epoch` claims
        (default `attempts`), of which `attempts` are not given back (default 1); the last
        lease expires in `lease_expires_in` seconds (default: the queue's lease). Waiting runs
        have attempts 0 by definition."""
        status = RunStatus(status)
        new = NewRun(
            tenant_id=tenant_id,
            principal=principal,
            agent="scripted",
            input={} if input is None else input,
            priority=klass.base,
            max_attempts=max_attempts,
            session_id=session_id,
        )
        run = await self.queue.enqueue(new)
        if status is RunStatus.QUEUED:
            return Made(await self._current(run.id), None)
        if status is RunStatus.CANCELLED:
            await self.queue.cancel(run.id, actor="factory")
            return Made(await self._current(run.id), None)
        attempts = 1 if attempts is None else attempts
        epoch = attempts if epoch is None else epoch
        if not 1 <= attempts <= epoch or attempts > max_attempts:
            raise ValueError("need 1 <= attempts <= epoch and attempts <= max_attempts")
        lease_seconds = self.queue.config.lease_seconds
        # attempts - 1 claims lost to lease expiry (each counts), then epoch - attempts claims
        # given back by a graceful release (none counts), then the current claim.
        for _ in range(attempts - 1):
            held = await self._claim(run.id, lease_seconds)
            self.clock.advance(lease_seconds + 1)
            await self.queue.sweep()
            self.clock.advance(self.queue.config.backoff_max_seconds + 1)
            assert (await self._current(held.run_id)).status == RunStatus.QUEUED
        for _ in range(epoch - attempts):
            held = await self._claim(run.id, lease_seconds)
            await self._written(self.queue.release(held, graceful=True, reason="factory"))
        lease = await self._claim(
            run.id, lease_seconds if lease_expires_in is None else lease_expires_in
        )
        if status is RunStatus.RUNNING:
            return Made(await self._current(run.id), lease)
        if status is RunStatus.WAITING_FOR_USER:
            await self._written(self.queue.wait_for_user(lease, "?", step=1, state={}))
        elif status is RunStatus.SUCCEEDED:
            await self._written(self.queue.complete(lease, {"made": True}))
        elif status is RunStatus.FAILED:
            await self._written(self.queue.fail(lease, {"kind": "factory", "message": "made"}))
        return Made(await self._current(run.id), None)

    async def _claim(self, run_id: UUID, lease_seconds: float) -> Lease:
        claimed = await self.queue.claim(OWNER, list(PriorityClass), lease_seconds=lease_seconds)
        assert [c.run.id for c in claimed] == [run_id], "the factory needs an otherwise empty queue"
        return claimed[0].lease

    async def _current(self, run_id: UUID) -> Run:
        run = await self.queue.get_run(run_id)
        assert run is not None
        return run

    @staticmethod
    async def _written(write: Any) -> None:
        assert isinstance(await write, Written)
