"""Model budgets with real worker processes against a fake endpoint enforcing limits of its
own (tests/support/limited_model.py; docs/model-budgets.md): a budget is exact across two
processes (no 429 while runs wait their turn, no attempt lost), a run waiting for capacity
holds no slot, a provider's 429 pauses the endpoint for every process, a worker killed
while its call holds a reservation gives the tokens back, interactive runs take the turns of
async runs waiting on the same budget, a tenant's flood does not put another tenant behind it,
and a tenant's own limit holds across processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.queue.core import Queue
from app.queue.model_budgets import endpoint_key
from app.vocabulary.records import NewRun
from tests.support.limited_model import LimitedModel
from tests.support.processes import turnstile
from tests.support.servers import running_server
from tests.support.waiting import eventually

ASYNC = 10
INTERACTIVE = 0
DEFAULT_MODEL = Settings.model_fields["openai_model"].default


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


async def owe_requests(engine: AsyncEngine, base: str, seconds: int) -> None:
    """The endpoint's request bucket `seconds` of its rate in debt (at 60 a minute), as after
    an earlier burst: every call from now on books a turn of its own, however slowly the
    machine claims the runs. Written once the workers are up: written before, their start-up
    would refill it (CI, 2026-12-02 and 12-07: no eight runs ever waited at once)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO model_budgets (endpoint, request_level, refilled_at, updated_at)"
                " VALUES (:endpoint, :level, now(), now())"
                " ON CONFLICT (endpoint) DO UPDATE"
                " SET request_level = :level, refilled_at = now()"
            ),
            {"endpoint": endpoint_key(f"{base}/v1", DEFAULT_MODEL), "level": -seconds},
        )


async def bookings_at_least(engine: AsyncEngine, count: int) -> bool:
    found = await rows(
        engine, "SELECT count(*) AS n FROM model_reservations WHERE wake_at IS NOT NULL"
    )
    return int(found[0]["n"]) >= count


async def enqueue(queue: Queue, count: int, agent: str = "openai") -> None:
    await queue.enqueue_many(
        tenant_id="t",
        principal="p",
        runs=[(agent, {"text": f"question {i}"}, ASYNC, None) for i in range(count)],
    )


async def test_a_budget_is_exact_across_two_processes(
    database_url: str, engine: AsyncEngine
) -> None:
    # 30 requests a minute, a bucket of 30: 31 runs at once, one waits its turn (no share of
    # it held for interactive calls, which none of these is: that share has its own tests).
    model = LimitedModel(rpm=30, slack=0.2)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(
            database_url, base, TURNSTILE_MODEL_RPM="30", TURNSTILE_MODEL_INTERACTIVE_SHARE="0"
        )
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
            # Ten past the minute's 30: runs of both processes are still to call when the first
            # 429 comes (with two past it, both could be one process's).
            await enqueue(queue, 40)
            await eventually(lambda: all_succeeded(engine, 40), within=120, what="every run")
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


async def test_a_tenants_flood_does_not_put_another_tenant_behind_it(
    database_url: str, engine: AsyncEngine
) -> None:
    """Fair between tenants on one budget, with two processes: a tenant whose async runs
    arrive while another tenant's flood waits for its turns takes the flood's next turns
    rather than waiting behind all of it (and the endpoint answers no 429)."""
    model = LimitedModel(rpm=60, slack=0.2)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(database_url, base, TURNSTILE_MODEL_RPM="60")
        async with workers(2, env):
            await owe_requests(engine, base, 20)  # the flood books its turns from 20 s on
            await queue.enqueue_many(
                tenant_id="flood",
                principal="p",
                runs=[("openai", {"text": f"flood {i}"}, ASYNC, None) for i in range(16)],
            )
            await eventually(
                lambda: bookings_at_least(engine, 8), within=60, what="the flood's bookings"
            )
            await queue.enqueue_many(
                tenant_id="late",
                principal="p",
                runs=[("openai", {"text": f"late {i}"}, ASYNC, None) for i in range(4)],
            )
            await eventually(lambda: all_succeeded(engine, 20), within=120, what="every run")
    assert model.refused == []
    finished = await rows(engine, "SELECT tenant_id FROM runs ORDER BY finished_at, id")
    last_late = max(i for i, r in enumerate(finished) if r["tenant_id"] == "late")
    after = [r for r in finished[last_late + 1 :] if r["tenant_id"] == "flood"]
    # Behind the whole flood, none of its runs would finish after the late tenant's last.
    assert len(after) >= 3


async def test_interactive_runs_take_the_turns_of_an_async_flood_waiting_on_the_budget(
    database_url: str, engine: AsyncEngine
) -> None:
    """Interactive before async within a budget, with two processes: interactive runs that
    arrive while async runs wait for their booked turns take the next of those turns, and
    finish before async runs that were waiting before they arrived (no 429, no attempt
    lost)."""
    model = LimitedModel(rpm=60, slack=0.2)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(database_url, base, TURNSTILE_MODEL_RPM="60")
        async with workers(2, env):
            await owe_requests(engine, base, 20)  # the async runs book from 20 s on
            await enqueue(queue, 12)
            await eventually(
                lambda: bookings_at_least(engine, 8), within=60, what="the async runs' bookings"
            )
            await queue.enqueue_many(
                tenant_id="t",
                principal="p",
                runs=[("openai", {"text": f"now {i}"}, INTERACTIVE, None) for i in range(4)],
            )
            await eventually(lambda: all_succeeded(engine, 16), within=120, what="every run")
    assert model.refused == []
    finished = await rows(engine, "SELECT priority FROM runs ORDER BY finished_at, id")
    last_interactive = max(i for i, r in enumerate(finished) if r["priority"] == INTERACTIVE)
    after = [r for r in finished[last_interactive + 1 :] if r["priority"] == ASYNC]
    # Behind the async runs that booked first, none would finish after the last interactive.
    assert len(after) >= 4
    attempts = await rows(engine, "SELECT DISTINCT attempts FROM runs")
    assert [r["attempts"] for r in attempts] == [1]


async def test_a_tenants_own_limit_holds_across_two_processes(
    database_url: str, engine: AsyncEngine
) -> None:
    """A tenant's own limit on an endpoint, with two processes: its calls past the limit wait
    for their turns within it (their slots given back, no attempt lost), each once, while
    another tenant's calls to the same endpoint never wait; the endpoint answers no 429."""
    model = LimitedModel(rpm=600, slack=0.2)
    queue = Queue(engine)
    async with running_server(model.app()) as base:
        env = worker_env(database_url, base, TURNSTILE_MODEL_RPM="600")
        async with workers(2, env):
            # 120 requests a minute for `small`, ten seconds of them owed already (written
            # once both workers are up, as the flood's debt above): each of its calls books a
            # turn of its own within its limit, however slowly the workers claim them.
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "INSERT INTO model_tenant_budgets (endpoint, tenant_id,"
                        " requests_per_minute, request_level, refilled_at, updated_at)"
                        " VALUES (:endpoint, 'small', 120, -20, now(), now())"
                    ),
                    {"endpoint": endpoint_key(f"{base}/v1", DEFAULT_MODEL)},
                )
            for tenant in ("small", "big"):
                await queue.enqueue_many(
                    tenant_id=tenant,
                    principal="p",
                    runs=[("openai", {"text": f"{tenant} {i}"}, ASYNC, None) for i in range(6)],
                )
            await eventually(lambda: all_succeeded(engine, 12), within=120, what="every run")
    assert model.refused == []
    waits = await capacity_waits(engine)
    tenants = await rows(engine, "SELECT id, tenant_id FROM runs")
    tenant_of = {r["id"]: r["tenant_id"] for r in tenants}
    waited = [tenant_of[w["run_id"]] for w in waits]
    assert sorted(waited) == ["small"] * 6  # each of its calls once; none of big's
    assert all("the tenant's requests a minute" in w["data"]["reason"] for w in waits)
    attempts = await rows(engine, "SELECT DISTINCT attempts FROM runs")
    assert [r["attempts"] for r in attempts] == [1]
    figures = {
        r["tenant_id"]: r
        for r in await rows(
            engine,
            "SELECT tenant_id, requests_used, waits FROM model_tenant_budgets WHERE endpoint <> ''",
        )
    }
    assert (figures["small"]["requests_used"], figures["small"]["waits"]) == (6, 6)
    assert (figures["big"]["requests_used"], figures["big"]["waits"]) == (6, 0)
    assert await rows(engine, "SELECT * FROM model_tenant_bookings") == []
