"""A tenant's holdings (issue 40 item 2): schedules and webhook endpoints are capped per tenant,
exactly even when creations race; a schedule fires at most once per the tenant's minimum
interval; both limits come from the settings with per-tenant overrides (`PUT
/tenants/{tenant}/limits`, `turnstile tenants set`); and a webhook delivery has a total
deadline, so a receiver trickling its answer cannot hold an async slot past it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.runtime.http_tool import HttpRequestTool
from app.runtime.tools import TransientToolError
from app.store.embedded import free_port
from tests.support.api import running_api
from tests.support.processes import run_cli
from tests.support.waiting import eventually

HOOKS: dict[str, Any] = {
    "secret_key": "k" * 40,
    "http_allowed_hosts": "127.0.0.1",
    "webhook_backoff_base_seconds": 0.05,
    "webhook_backoff_max_seconds": 0.1,
}
NIGHTLY = {"cron": "0 3 * * *", "input": {"report": "nightly"}}


async def scalar(engine: AsyncEngine, sql: str) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql))).scalar_one()


def assert_limit_reached(response: httpx.Response, kind: str, limit: int) -> None:
    assert response.status_code == 409, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == "/problems/limit-reached"
    assert (problem["kind"], problem["limit"], problem["held"]) == (kind, limit, limit)


async def test_schedules_are_capped_per_tenant_even_when_creations_race(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, tenant_max_schedules=2) as api:
        ops = await api.client("acme", "ops", "operator")
        # Six at once against a cap of two: the holdings lock makes them count in turn.
        answers = await asyncio.gather(*(ops.post("/schedules", json=NIGHTLY) for _ in range(6)))
        assert sorted(a.status_code for a in answers) == [201, 201, 409, 409, 409, 409]
        assert_limit_reached(next(a for a in answers if a.status_code == 409), "schedules", 2)
        # Paused schedules still count; another tenant has a cap of its own.
        first = next(a for a in answers if a.status_code == 201).json()
        assert (await ops.post(f"/schedules/{first['id']}/pause")).status_code == 200
        assert_limit_reached(await ops.post("/schedules", json=NIGHTLY), "schedules", 2)
        other = await api.client("globex", "ops", "operator")
        assert (await other.post("/schedules", json=NIGHTLY)).status_code == 201
        # An admin raises acme's own cap: one more fits, then the new cap holds.
        admin = await api.client("platform", "sre", "admin")
        raised = await admin.put("/tenants/acme/limits", json={"max_schedules": 3})
        assert raised.status_code == 200, raised.text
        assert raised.json()["effective"]["max_schedules"] == 3
        assert (await ops.post("/schedules", json=NIGHTLY)).status_code == 201
        assert_limit_reached(await ops.post("/schedules", json=NIGHTLY), "schedules", 3)
        # Deleting one makes room.
        assert (await ops.delete(f"/schedules/{first['id']}")).status_code == 200
        assert (await ops.post("/schedules", json=NIGHTLY)).status_code == 201
    assert await scalar(engine, "SELECT count(*) FROM schedules WHERE tenant_id = 'acme'") == 3
    # Every refused creation wrote nothing: one tick ahead per active schedule, no more.
    assert await scalar(engine, "SELECT count(*) FROM runs WHERE tenant_id = 'acme'") == 3


async def test_a_schedule_fires_at_most_once_per_the_minimum_interval(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:  # the default minimum: 60 s
        ops = await api.client("acme", "ops", "operator")
        for cron in ("*/2 * * * * *", "0,30 * * * * *", "0,59 * * * * *"):
            refused = await ops.post("/schedules", json={**NIGHTLY, "cron": cron})
            assert refused.status_code == 422, (cron, refused.text)
            problem = refused.json()
            assert problem["type"] == "/problems/invalid-request"
            assert problem["errors"][0]["loc"] == ["body", "cron"]
            assert "at most once every 60 s" in problem["detail"]
        assert await scalar(engine, "SELECT count(*) FROM schedules") == 0
        # Six fields are fine when they fire a minute apart or more; five always are.
        for cron in ("30 * * * * *", "* * * * *"):
            created = await ops.post("/schedules", json={**NIGHTLY, "cron": cron})
            assert created.status_code == 201, (cron, created.text)
        # A tenant's own minimum, either way: every two seconds allowed for acme...
        admin = await api.client("platform", "sre", "admin")
        lowered = await admin.put("/tenants/acme/limits", json={"min_schedule_interval_seconds": 2})
        assert lowered.json()["effective"]["min_schedule_interval_seconds"] == 2
        every_two = {**NIGHTLY, "cron": "*/2 * * * * *"}
        assert (await ops.post("/schedules", json=every_two)).status_code == 201
        # ...and hourly at most for globex, so an every-minute schedule is refused.
        await admin.put("/tenants/globex/limits", json={"min_schedule_interval_seconds": 3600})
        globex = await api.client("globex", "ops", "operator")
        refused = await globex.post("/schedules", json={**NIGHTLY, "cron": "*/30 * * * *"})
        assert refused.status_code == 422
        assert "1800 s apart" in refused.json()["detail"]
        assert (await globex.post("/schedules", json=NIGHTLY)).status_code == 201
        bad = await admin.put("/tenants/acme/limits", json={"min_schedule_interval_seconds": 0})
        assert bad.status_code == 422
        assert bad.json()["errors"][0]["loc"] == ["body", "min_schedule_interval_seconds"]


async def test_webhook_endpoints_are_capped_per_tenant(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, tenant_max_webhook_endpoints=2, **HOOKS) as api:
        ops = await api.client("acme", "ops", "operator")
        hook = {"url": "http://127.0.0.1:9/hooks"}
        answers = await asyncio.gather(*(ops.post("/webhooks", json=hook) for _ in range(5)))
        assert sorted(a.status_code for a in answers) == [201, 201, 409, 409, 409]
        assert_limit_reached(
            next(a for a in answers if a.status_code == 409), "webhook_endpoints", 2
        )
        # A deleted endpoint no longer counts.
        [first, _] = (await ops.get("/webhooks")).json()["webhooks"]
        assert (await ops.delete(f"/webhooks/{first['id']}")).status_code == 200
        assert (await ops.post("/webhooks", json=hook)).status_code == 201
        assert_limit_reached(await ops.post("/webhooks", json=hook), "webhook_endpoints", 2)
    live = "SELECT count(*) FROM webhook_endpoints WHERE deleted_at IS NULL"
    assert await scalar(engine, live) == 2


async def test_holdings_limits_from_the_cli(database_url: str, engine: AsyncEngine) -> None:
    env = {"DATABASE_URL": database_url}
    code, out, err = await run_cli(
        "tenants", "set", "acme", "--max-schedules", "1", "--max-webhook-endpoints", "0",
        "--min-schedule-interval", "5", "--json", env=env,
    )  # fmt: skip
    assert code == 0, err
    assert '"max_schedules": 1' in out
    assert '"min_schedule_interval_seconds": 5' in out
    create = ("schedules", "create", "--tenant", "acme", "--input", "{}")
    code, out, err = await run_cli(*create, "--cron", "*/2 * * * * *", env=env)
    assert code == 2, out
    assert "at most once every 5 s" in err
    assert "Traceback" not in err
    code, out, err = await run_cli(*create, "--cron", "*/5 * * * * *", env=env)
    assert code == 0, err
    code, out, err = await run_cli(*create, "--cron", "0 3 * * *", env=env)
    assert code == 2
    assert "its limit is 1" in err
    assert "Traceback" not in err
    assert err.count("\n") <= 1
    code, out, err = await run_cli("tenants", "set", "acme", "--max-schedules", "-1", env=env)
    assert code == 2
    assert "max_schedules" in err
    assert "Traceback" not in err
    code, out, err = await run_cli("tenants", "set", "acme", "--max-schedules", "default", env=env)
    assert code == 0, err
    assert await scalar(engine, "SELECT count(*) FROM schedules") == 1


@contextlib.asynccontextmanager
async def trickling_receiver(byte_every: float = 0.2) -> AsyncIterator[str]:
    """An HTTP server on loopback that answers 200 with a body it sends one byte at a time,
    forever: every read gets a byte well within any per-read timeout."""
    handlers: set[asyncio.Task[None]] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            while True:
                writer.write(b".")
                await writer.drain()
                await asyncio.sleep(byte_every)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up: what the deadline is for
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()
            handlers.discard(task)

    server = await asyncio.start_server(answer, "127.0.0.1", free_port())
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/hooks"
    finally:
        server.close()
        for handler in list(handlers):
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def test_a_request_past_its_deadline_is_abandoned_as_transient() -> None:
    async with trickling_receiver() as url:
        tool = HttpRequestTool(["127.0.0.1"], timeout_seconds=10.0, deadline_seconds=0.5)
        with pytest.raises(TransientToolError, match=r"within the deadline of 0\.5 s") as caught:
            await tool.request("POST", url, {}, content=b"{}")
        assert caught.value.sent  # it may have reached the receiver: retried as keyed


async def test_a_trickling_receiver_cannot_hold_a_delivery_past_its_deadline(
    database_url: str, engine: AsyncEngine
) -> None:
    async with (
        trickling_receiver() as url,
        running_api(
            database_url, engine, workers=True, webhook_max_attempts=2, webhook_timeout_seconds=0.5,
            **HOOKS,
        ) as api,
    ):  # fmt: skip
        ops = await api.client("acme", "ops", "operator")
        assert (await ops.post("/webhooks", json={"url": url})).status_code == 201
        client = await api.client("acme", "alice")
        submitted = await client.post("/runs", json={"input": {"final": "x"}})
        assert submitted.status_code == 202

        async def dead_letter() -> Any:
            async with engine.connect() as conn:
                return (
                    await conn.execute(
                        text(
                            "SELECT r.attempts, r.failure FROM webhook_deliveries d "
                            "JOIN runs r ON r.id = d.run_id WHERE r.status = 'failed'"
                        )
                    )
                ).one_or_none()

        attempts, failure = await eventually(dead_letter, what="the delivery's dead letter")
    assert attempts == 2
    assert failure["kind"] == "attempts_exhausted"
    assert "within the deadline of 0.5 s" in failure["message"]
