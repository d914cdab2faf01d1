"""The test factory makes runs in any state through the queue's own transitions: each has the
status, epoch, attempts and lease asked for, and a log that passes the shared invariants."""

from __future__ import annotations

import pytest

from app.queue.core import Queue
from app.vocabulary.statuses import RunStatus
from tests.support.clock import ManualClock
from tests.support.factory import RunFactory
from tests.support.invariants import check_all_runs


@pytest.mark.parametrize("status", list(RunStatus))
async def test_every_status(queue: Queue, clock: ManualClock, status: RunStatus) -> None:
    made = await RunFactory(queue, clock).make(status)
    assert made.run.status == status
    assert (made.lease is not None) == (status is RunStatus.RUNNING)
    assert await check_all_runs(queue.engine) == 1


async def test_epoch_attempts_and_lease_expiry(queue: Queue, clock: ManualClock) -> None:
    made = await RunFactory(queue, clock).make(
        RunStatus.RUNNING, epoch=5, attempts=3, lease_expires_in=-1
    )
    assert (made.run.lease_epoch, made.run.attempts) == (5, 3)
    assert made.lease is not None
    assert made.lease.epoch == 5
    assert made.run.lease_expires_at is not None
    assert made.run.lease_expires_at < clock.now  # expired, as asked: the sweeper's to take
    swept = await queue.sweep()
    assert (swept.requeued, swept.failed) == (0, 1)  # the third attempt of three was the last
    assert await check_all_runs(queue.engine) == 1


async def test_refuses_an_impossible_state(queue: Queue, clock: ManualClock) -> None:
    with pytest.raises(ValueError, match="attempts"):
        await RunFactory(queue, clock).make(RunStatus.RUNNING, epoch=1, attempts=2)
