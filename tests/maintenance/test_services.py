"""Maintenance services: one holder at a time through the lease row (taken over when the holder
stops or dies), pruning of expired idempotency keys, and retention of finished runs that never
touches the undismissed dead letter."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from app.maintenance.pruners import IdempotencyPruner, RunRetention
from app.queue.core import Queue
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.clock import ManualClock


async def scalar(queue: Queue, sql: str, **params: Any) -> Any:
    async with queue.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


async def test_one_holder_at_a_time_and_takeover(queue: Queue, clock: ManualClock) -> None:
    first = IdempotencyPruner(queue, holder="process-a", interval=10)
    second = IdempotencyPruner(queue, holder="process-b", interval=10)
    assert await first.tick() is True
    assert await second.tick() is False  # a's lease is live
    assert await first.tick() is True  # the holder renews
    clock.advance(first.lease_seconds + 1)  # a crashed: it renews no more
    assert await second.tick() is True
    assert await first.tick() is False
    await second.stop()  # a clean stop hands the lease over at once
    assert await first.tick() is True
    holder = await scalar(
        queue, "SELECT holder FROM maintenance_leases WHERE name = :n", n="idempotency-pruner"
    )
    assert holder == "process-a"
    assert await scalar(
        queue,
        "SELECT last_success_at IS NOT NULL FROM maintenance_leases WHERE name = :n",
        n="idempotency-pruner",
    )


async def test_expired_idempotency_keys_are_pruned(queue: Queue, clock: ManualClock) -> None:
    async with queue.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO idempotency_keys (tenant_id, principal, key, request_hash, "
                "response_status, response_body, expires_at) "
                "SELECT 't', 'p', 'k' || n, 'h', 202, '{}', CAST(:now AS timestamptz) + "
                "CASE WHEN n % 2 = 0 THEN interval '-1 second' ELSE interval '1 hour' END "
                "FROM generate_series(1, 25) AS n"
            ),
            {"now": clock.now},
        )
    pruner = IdempotencyPruner(queue, holder="a", interval=1, batch=5)
    assert (await pruner.run_once()).deleted == 12
    assert await scalar(queue, "SELECT count(*) FROM idempotency_keys") == 13


async def test_retention_keeps_the_dead_letter_until_dismissed(
    queue: Queue, clock: ManualClock
) -> None:
    async def finished(how: str) -> Any:
        run = await queue.enqueue(
            NewRun(
                tenant_id="t",
                principal="p",
                agent="scripted",
                input={},
                priority=PriorityClass.ASYNC.base,
            )
        )
        if how == "cancelled":
            await queue.cancel(run.id, actor="op")
            return run.id
        lease = (await queue.claim("w", [PriorityClass.ASYNC]))[0].lease
        if how == "succeeded":
            await queue.complete(lease, {})
        elif how.startswith("failed"):
            await queue.fail(lease, {"kind": "permanent"})
        elif how == "running":
            pass
        return run.id

    old = {how: await finished(how) for how in ("succeeded", "cancelled", "failed", "failed-ok")}
    async with queue.engine.begin() as conn:
        await conn.execute(
            text("UPDATE runs SET dismissed_at = :now WHERE id = :id"),
            {"now": clock.now, "id": old["failed-ok"]},
        )
    running = await finished("running")
    clock.advance(8 * 86_400)
    recent = await finished("succeeded")

    retention = RunRetention(queue, holder="a", interval=1, retention_seconds=7 * 86_400, batch=2)
    assert (await retention.run_once()).deleted == 3
    async with queue.engine.connect() as conn:
        left = set((await conn.execute(text("SELECT id FROM runs"))).scalars())
    assert left == {old["failed"], running, recent}
    # Their events, inputs and the rest went with them.
    assert (
        await scalar(
            queue, "SELECT count(*) FROM run_events WHERE run_id = :id", id=old["succeeded"]
        )
        == 0
    )
