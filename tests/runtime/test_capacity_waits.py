"""Model budgets with real worker processes against a fake endpoint enforcing limits of its
own (tests/support/limited_model.py; docs/model-budgets.md): a budget is exact across two
processes (no 429 while runs wait their turn, no attempt lost), a run waiting for capacity
holds no slot, a provider's 429 pauses the endpoint for every process, and a worker killed
while its call holds a reservation gives the tokens back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.vocabulary.records import NewRun
from tests.support.limited_model import LimitedModel
from tests.support.processes import turnstile
from tests.support.servers import running_server
from tests.support.waiting import eventually

ASYNC = 10


def worker_env(database_url: str, base: str, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
        "TURNSTILE_OPENAI_BASE_URL": f"{base}/v1",
        "TURNSTILE_OPENAI_STREAM": "false",
        "TURNSTILE_OPENAI_MAX_OUTPUT_TOKENS": "20",
        "TURNSTILE_POLL_INTERVAL_SECONDS": "0.2",
        "TURNSTILE_SLOTS": "interactive:2,async:4,maintenance:1",
        **extra,
    }


@asynccontextmanager
async def workers(count: int, env: dict[str, str]) -> AsyncIterator[None]:
    async with turnstile("worker", ready=b"running slots", env=env):
        if count == 1:
            yield
            return
        async with turnstile("worker", ready=b"running slots", env=env):
            yield


async def rows(engine: AsyncEngine, sql: str, **params: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(sql), params)).mappings().all())


async def all_succeeded(engine: AsyncEngine, count: int) -> bool:
    done = await rows(engine, "SELECT count(*) AS n FROM runs WHERE status = 'succeeded'")
    return int(done[0]["n"]) == count


async def capacity_waits(engine: AsyncEngine) -> list[Any]:
    """Each wait for capacity, with the owner of the claim it ended."""
    return await rows(
        engine,
        "SELECT e.run_id, e.data, c.data ->> 'owner' AS owner FROM run_events e "
        "JOIN run_events c ON c.run_id = e.run_id AND c.epoch = e.epoch "
        "AND c.type = 'run.claimed' "
        "WHERE e.type = 'run.released' AND e.data ->> 'waited_for' = 'capacity'",
    )


async def enqueue(queue: Queue, count: int, agent: str = "openai") -> None:
    await queue.enqueue_many(
        tenant_id="t",
        principal="p",
        runs=[(agent, {"text": f"question {i}"}, ASYNC, None) for i in range(count)],
    )


async def test_a_budget_is_exact_across_two_processes(
    database_url: str, engine: AsyncEngine
) -> None:
    # 30 requests a minute, a bucket of 30: 31 runs at once, one waits its turn.
    model = LimitedModel(rpm=30, slack=0.2)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(database_url, base, TURNSTILE_MODEL_RPM="30")
        async with workers(2, env):
            await enqueue(queue, 31)  # both processes ready: both claim
            await eventually(lambda: all_succeeded(engine, 31), within=60, what="every run")
    assert model.refused == []
    assert len(model.served) == 31
    waits = await capacity_waits(engine)
    assert len(waits) >= 1
    assert all("requests a minute" in w["data"]["reason"] for w in waits)
    attempts = await rows(engine, "SELECT DISTINCT attempts FROM runs")
    assert [r["attempts"] for r in attempts] == [1]  # a wait is no attempt
    owners = await rows(
        engine, "SELECT DISTINCT data ->> 'owner' AS o FROM run_events WHERE type = 'run.claimed'"
    )
    assert len(owners) == 2
    (budget,) = await rows(engine, "SELECT requests_used, tokens_used FROM model_budgets")
    assert budget["requests_used"] == 31
    assert budget["tokens_used"] == model.tokens  # settled with the reported usage


async def test_a_run_waiting_for_capacity_holds_no_slot(
    database_url: str, engine: AsyncEngine
) -> None:
    model = LimitedModel()
    queue = Queue(engine)
    # One request a minute: the second model call must wait about a minute.
    await enqueue(queue, 2)
    scripted = await queue.enqueue(
        NewRun(tenant_id="t", principal="p", agent="scripted", input={}, priority=ASYNC)
    )
    async with running_server(model.app()) as base:
        env = worker_env(
            database_url,
            base,
            TURNSTILE_MODEL_RPM="1",
            TURNSTILE_SLOTS="interactive:1,async:1,maintenance:1",
        )
        async with workers(1, env):

            async def scripted_done() -> bool:
                run = await queue.get_run(scripted.id)
                return run is not None and run.status == "succeeded"

            # The one async slot runs the scripted run while the second call waits.
            await eventually(scripted_done, within=30, what="the scripted run")
            (waiting,) = await rows(
                engine,
                "SELECT status, lease_owner, attempts, scheduled_for - now() AS due_in "
                "FROM runs WHERE agent = 'openai' AND status <> 'succeeded'",
            )
    assert waiting["status"] == "queued"
    assert waiting["lease_owner"] is None
    assert waiting["attempts"] == 0
    assert waiting["due_in"].total_seconds() > 30
    (wait,) = await capacity_waits(engine)
    assert "requests a minute" in wait["data"]["reason"]
    assert wait["data"]["retry_at"]
    assert len(model.served) == 1


async def test_a_429_pauses_the_endpoint_for_every_process(
    database_url: str, engine: AsyncEngine
) -> None:
    # No budget of our own: the provider's limit, 30 a minute, answers 429 past it.
    model = LimitedModel(rpm=30)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(database_url, base)
        async with workers(2, env):
            await enqueue(queue, 32)
            await eventually(lambda: all_succeeded(engine, 32), within=90, what="every run")
    assert model.refused
    (budget,) = await rows(engine, "SELECT pauses, paused_until FROM model_budgets")
    assert budget["pauses"] == len(model.refused)  # every 429 paused the endpoint
    paused = [w for w in await capacity_waits(engine) if "paused" in w["data"]["reason"]]
    # Runs of both processes waited the pause out, in neither's slot.
    assert len({w["owner"] for w in paused}) == 2
    attempts = await rows(engine, "SELECT DISTINCT attempts FROM runs")
    assert [r["attempts"] for r in attempts] == [1]


async def test_a_crash_while_holding_a_reservation_gives_the_tokens_back(
    database_url: str, engine: AsyncEngine
) -> None:
    # A call reserves over half the minute's tokens (the 3000 output tokens it may produce):
    # had the dead worker's reservation stayed, the next call would wait for the refill.
    model = LimitedModel(hold=asyncio.Event())
    queue = Queue(engine)
    await enqueue(queue, 1)
    async with running_server(model.app()) as base:
        env = worker_env(
            database_url,
            base,
            TURNSTILE_MODEL_TPM="5000",
            TURNSTILE_OPENAI_MAX_OUTPUT_TOKENS="3000",
            TURNSTILE_LEASE_SECONDS="2",
            TURNSTILE_HEARTBEAT_SECONDS="0.5",
            TURNSTILE_SWEEP_INTERVAL_SECONDS="0.3",
            TURNSTILE_RETRY_BACKOFF_BASE_SECONDS="0.1",
        )
        async with turnstile("worker", ready=b"running slots", env=env) as first:
            await asyncio.wait_for(model.arrived.wait(), 30)
            (held,) = await rows(engine, "SELECT tokens FROM model_reservations")
            assert held["tokens"] > 2500
            first.process.kill()  # SIGKILL, in the middle of the call
            await first.process.wait()
        model.hold.set()  # type: ignore[union-attr]
        async with workers(1, env):
            await eventually(lambda: all_succeeded(engine, 1), within=60, what="the run")
    assert await capacity_waits(engine) == []  # the tokens were back: no wait
    assert await rows(engine, "SELECT * FROM model_reservations") == []
    (budget,) = await rows(engine, "SELECT requests_used FROM model_budgets")
    assert budget["requests_used"] == 1  # the dead call was never settled
