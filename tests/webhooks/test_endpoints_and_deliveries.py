"""Webhooks end to end: endpoints over HTTP (operator scope, the secret shown once, the URL
checked like http_request's, refused without TURNSTILE_SECRET_KEY), and signed deliveries to a
receiver on loopback: one per transition, from the transition's own statement (a fenced write
makes none), retried with the same webhook-id, dead-lettered with a clear failure, never to
another tenant, never from a deleted endpoint, never about a delivery."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.queue.webhook_endpoints import Webhooks
from app.runtime.http_tool import HttpRequestTool
from app.runtime.webhook_delivery import register_endpoint
from app.security.secret_box import SecretBox
from app.store.embedded import free_port
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, NewRun
from tests.support.api import Api, running_api
from tests.support.processes import run_cli, turnstile
from tests.support.waiting import eventually
from tests.support.webhook_receiver import Receiver, receiver

SECRET_KEY = "k" * 40
WEBHOOKS_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "webhooks.md"


def readme_verify() -> Callable[[str, dict[str, str], bytes], bool]:
    """The receiver's `verify` exactly as the webhooks guide shows it."""
    section = WEBHOOKS_GUIDE.read_text(encoding="utf-8")
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/guides/webhooks.md", "exec"), namespace)  # noqa: S102 (our own docs)
    verify: Callable[[str, dict[str, str], bytes], bool] = namespace["verify"]
    return verify


HOOKS: dict[str, Any] = {
    "secret_key": SECRET_KEY,
    "http_allowed_hosts": "127.0.0.1",  # the receiver's address, listed literally
    "webhook_backoff_base_seconds": 0.05,
    "webhook_backoff_max_seconds": 0.2,
}


async def scalar(engine: AsyncEngine, sql: str, **params: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


async def create_hook(ops: httpx.AsyncClient, url: str, events: list[str] | None = None) -> Any:
    created = await ops.post("/webhooks", json={"url": url, "events": events or []})
    assert created.status_code == 201, created.text
    return created.json()


async def run_until(api: Api, client: httpx.AsyncClient, body: Any, *statuses: str) -> Any:
    submitted = await client.post("/runs", json={"input": body})
    assert submitted.status_code == 202, submitted.text
    run_id = submitted.json()["id"]

    async def finished() -> Any:
        doc = (await client.get(f"/runs/{run_id}")).json()
        return doc if doc["status"] in statuses else None

    return await eventually(finished, what=f"run {run_id} in {statuses}")


async def delivery_runs(engine: AsyncEngine, status: str | None = None) -> list[Any]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT r.id, r.status, r.attempts, r.failure, d.event, d.source_run_id, "
                "r.tenant_id FROM webhook_deliveries d JOIN runs r ON r.id = d.run_id "
                "WHERE CAST(:status AS text) IS NULL OR r.status = :status ORDER BY r.created_at"
            ),
            {"status": status},
        )
        return list(rows.mappings())


async def test_creating_a_webhook_needs_the_secret_key(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, http_allowed_hosts="127.0.0.1") as api:
        ops = await api.client("acme", "ops", "operator")
        refused = await ops.post("/webhooks", json={"url": "http://127.0.0.1:9/x"})
        assert refused.status_code == 409
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == "/problems/secret-key-missing"
        assert "TURNSTILE_SECRET_KEY" in refused.json()["detail"]
    assert await scalar(engine, "SELECT count(*) FROM webhook_endpoints") == 0


async def test_endpoints_operator_scope_checked_urls_and_secret_shown_once(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, **HOOKS) as api:
        user = await api.client("acme", "alice")
        assert (await user.post("/webhooks", json={"url": "http://127.0.0.1/x"})).status_code == 403
        ops = await api.client("acme", "ops", "operator")
        for url in (
            "http://10.0.0.7/hook",  # internal, not listed
            "http://169.254.169.254/latest",  # cloud metadata
            "http://example.invalid/hook",  # not on the allow-list
            "ftp://127.0.0.1/hook",
        ):
            refused = await ops.post("/webhooks", json={"url": url})
            assert refused.status_code == 422, (url, refused.text)
            assert refused.json()["type"] == "/problems/destination-refused"
        bad_event = await ops.post("/webhooks", json={"url": "http://127.0.0.1/x", "events": ["x"]})
        assert bad_event.status_code == 422
        created = await create_hook(ops, "http://127.0.0.1:9/x", ["run.failed"])
        assert created["secret"].startswith("whsec_")
        assert created["events"] == ["run.failed"]
        listed = (await ops.get("/webhooks")).json()["webhooks"]
        assert [w["id"] for w in listed] == [created["id"]]
        assert "secret" not in listed[0]
        rotated = (await ops.post(f"/webhooks/{created['id']}/rotate-secret")).json()
        assert rotated["secret"].startswith("whsec_")
        assert rotated["secret"] != created["secret"]
        other = await api.client("other", "ops", "operator")
        assert (await other.get("/webhooks")).json()["webhooks"] == []
        assert (await other.delete(f"/webhooks/{created['id']}")).status_code == 404
        deleted = await ops.delete(f"/webhooks/{created['id']}")
        assert deleted.status_code == 200
        assert deleted.json()["cancelled_deliveries"] == 0
        assert (await ops.get("/webhooks")).json()["webhooks"] == []
    stored = await scalar(engine, "SELECT secret_ciphertext FROM webhook_endpoints")
    assert rotated["secret"].removeprefix("whsec_").encode() not in bytes(stored)


async def test_one_signed_delivery_per_transition_and_none_about_deliveries(
    database_url: str, engine: AsyncEngine
) -> None:
    async with receiver() as hook, running_api(database_url, engine, workers=True, **HOOKS) as api:
        ops = await api.client("acme", "ops", "operator")
        created = await create_hook(ops, hook.url)
        client = await api.client("acme", "alice")
        succeeded = await run_until(api, client, {"script": [{"final": "ok"}]}, "succeeded")
        failed = await run_until(api, client, {"script": ["not a step"]}, "failed")
        waiting = await run_until(api, client, {"script": [{"ask": "which?"}]}, "waiting_for_user")
        assert (await client.post(f"/runs/{waiting['id']}/cancel")).status_code == 200
        await eventually(lambda: _count(hook, 4), what="four deliveries", within=30)
        deliveries = await eventually(
            lambda: _all_succeeded(engine, 4), what="deliveries succeeded", within=30
        )
    by_event = {d.json["type"]: d for d in hook.deliveries}
    assert sorted(by_event) == ["run.cancelled", "run.failed", "run.succeeded", "run.waiting"]
    assert len(hook.deliveries) == 4  # each once; and deliveries delivered nothing about them
    for delivery in hook.deliveries:
        assert hook.verify(created["secret"], delivery), delivery.headers
        assert delivery.headers["content-type"] == "application/json"
    ok = by_event["run.succeeded"].json["data"]
    assert ok["run_id"] == succeeded["id"]
    assert ok["status"] == "succeeded"
    assert ok["result"]["final"] == "ok"
    assert by_event["run.failed"].json["data"]["failure"]["kind"] == "agent_error"
    assert by_event["run.waiting"].json["data"]["question"] == "which?"
    assert by_event["run.cancelled"].json["data"]["run_id"] == waiting["id"]
    # webhook-id is the delivery run's id.
    assert {d.id for d in hook.deliveries} == {str(d["id"]) for d in deliveries}
    assert {str(d["source_run_id"]) for d in deliveries} >= {succeeded["id"], failed["id"]}
    assert await scalar(engine, "SELECT count(*) FROM runs WHERE agent = 'webhook'") == 4


async def _count(hook: Receiver, n: int) -> bool:
    return len(hook.deliveries) >= n


async def _all_succeeded(engine: AsyncEngine, n: int) -> list[Any] | None:
    rows = await delivery_runs(engine, "succeeded")
    return rows if len(rows) == n else None


async def test_500_twice_then_200_is_delivered_on_the_third_try_with_the_same_id(
    database_url: str, engine: AsyncEngine
) -> None:
    async with receiver() as hook, running_api(database_url, engine, workers=True, **HOOKS) as api:
        hook.statuses = [500, 503]
        ops = await api.client("acme", "ops", "operator")
        created = await create_hook(ops, hook.url, ["run.succeeded"])
        client = await api.client("acme", "alice")
        await run_until(api, client, {"final": "x"}, "succeeded")
        [delivery] = await eventually(
            lambda: _all_succeeded(engine, 1), what="the delivery", within=30
        )
        scraped = (await client.get("/metrics")).text
    assert 'turnstile_webhook_delivery_attempts_total{outcome="retry"} 2.0' in scraped
    assert 'turnstile_webhook_delivery_attempts_total{outcome="delivered"} 1.0' in scraped
    assert len(hook.deliveries) == 3
    assert {d.id for d in hook.deliveries} == {str(delivery["id"])}
    assert all(hook.verify(created["secret"], d) for d in hook.deliveries)
    verify = readme_verify()
    assert all(verify(created["secret"], d.headers, d.body) for d in hook.deliveries)
    assert not verify(created["secret"], hook.deliveries[0].headers, b"{}")
    assert delivery["attempts"] == 3
    # The endpoint's failures in a row were counted, then reset by the success.
    assert await scalar(engine, "SELECT consecutive_failures FROM webhook_endpoints") == 0


async def test_an_unreachable_receiver_ends_in_the_dead_letter_and_is_disabled(
    database_url: str, engine: AsyncEngine
) -> None:
    closed = f"http://127.0.0.1:{free_port()}/hooks"  # nothing listens there
    async with running_api(
        database_url, engine, workers=True, webhook_max_attempts=2, webhook_disable_after=2,
        **HOOKS,
    ) as api:  # fmt: skip
        ops = await api.client("acme", "ops", "operator")
        await create_hook(ops, closed)
        client = await api.client("acme", "alice")
        await run_until(api, client, {"final": "x"}, "succeeded")
        [first] = await eventually(
            lambda: _rows_or_none(delivery_runs(engine, "failed")), what="dead letter", within=30
        )
        # One failed delivery (two failed attempts): counted once, the endpoint stays enabled.
        [listed] = (await ops.get("/webhooks")).json()["webhooks"]
        assert (listed["enabled"], listed["consecutive_failures"]) == (True, 1)
        assert "webhook.endpoint_disabled" not in await _event_types(ops, first["id"])

        await run_until(api, client, {"final": "y"}, "succeeded")
        dead = await eventually(
            lambda: _rows_or_none(delivery_runs(engine, "failed"), at_least=2),
            what="the second dead letter",
            within=30,
        )
        # The second failed delivery in a row disabled it, and its run's events say so.
        [listed] = (await ops.get("/webhooks")).json()["webhooks"]
        assert (listed["enabled"], listed["consecutive_failures"]) == (False, 2)
        events = (await ops.get(f"/runs/{dead[1]['id']}/events")).json()["events"]
        [disabled] = [e for e in events if e["type"] == "webhook.endpoint_disabled"]
        assert disabled["data"] == {
            "endpoint_id": listed["id"],
            "consecutive_failed_deliveries": 2,
            "disable_after": 2,
        }
        # A disabled endpoint receives no more deliveries...
        await run_until(api, client, {"final": "z"}, "succeeded")
        assert await scalar(engine, "SELECT count(*) FROM webhook_deliveries") == 2
        # ...until an operator re-enables it: its count starts again, deliveries resume.
        enabled = await ops.post(f"/webhooks/{listed['id']}/enable")
        assert enabled.status_code == 200, enabled.text
        assert (enabled.json()["enabled"], enabled.json()["consecutive_failures"]) == (True, 0)
        await run_until(api, client, {"final": "again"}, "succeeded")
        assert await scalar(engine, "SELECT count(*) FROM webhook_deliveries") == 3
        other = await api.client("other", "ops", "operator")
        assert (await other.post(f"/webhooks/{listed['id']}/enable")).status_code == 404
    assert [d["attempts"] for d in dead] == [2, 2]
    assert dead[1]["failure"]["kind"] == "attempts_exhausted"
    assert "could not connect" in dead[1]["failure"]["message"]
    # A failed delivery reports nothing itself.
    assert await scalar(engine, "SELECT count(*) FROM webhook_deliveries") == 3


async def _event_types(client: httpx.AsyncClient, run_id: UUID) -> list[str]:
    answer = await client.get(f"/runs/{run_id}/events")
    assert answer.status_code == 200, answer.text
    return [e["type"] for e in answer.json()["events"]]


async def _rows_or_none(rows: Any, *, at_least: int = 1) -> list[Any] | None:
    found: list[Any] = await rows
    return found if len(found) >= at_least else None


async def test_a_destination_refused_at_delivery_fails_permanently(
    database_url: str, engine: AsyncEngine
) -> None:
    async with receiver() as hook:
        async with running_api(database_url, engine, **HOOKS) as api:
            ops = await api.client("acme", "ops", "operator")
            await create_hook(ops, hook.url)
            client = await api.client("acme", "alice")
            await client.post("/runs", json={"input": {"final": "x"}})
        # The allow-list changed since: the delivery is refused when it would be sent.
        refusing = {**HOOKS, "http_allowed_hosts": "example.com"}
        async with running_api(database_url, engine, workers=True, **refusing):
            [dead] = await eventually(
                lambda: _rows_or_none(delivery_runs(engine, "failed")), what="refusal", within=30
            )
        assert dead["attempts"] == 1  # permanent: never retried
        assert dead["failure"]["kind"] == "tool_error"
        assert "not on the allow-list" in dead["failure"]["message"]
        assert hook.deliveries == []
        # The runbook's resubmit sends it again, under the same webhook-id, once the
        # destination is allowed again.
        async with running_api(database_url, engine, workers=True, **HOOKS) as api:
            ops = await api.client("acme", "ops", "operator")
            resubmitted = await ops.post(f"/runs/{dead['id']}/resubmit")
            assert resubmitted.status_code == 202, resubmitted.text
            await eventually(lambda: _count(hook, 1), what="the resubmitted delivery")
    assert [d.id for d in hook.deliveries] == [str(dead["id"])]
    assert resubmitted.json()["max_attempts"] == 12


async def test_no_delivery_for_another_tenant_or_a_fenced_write_or_a_deleted_endpoint(
    database_url: str, engine: AsyncEngine
) -> None:
    async with receiver() as hook, running_api(database_url, engine, **HOOKS) as api:
        ops = await api.client("acme", "ops", "operator")
        created = await create_hook(ops, hook.url)
        queue = Queue(engine)

        async def transition(tenant: str) -> tuple[UUID, int]:
            run = await queue.enqueue(
                NewRun(tenant_id=tenant, principal="p", agent="scripted", input={})
            )
            [claimed] = await queue.claim("w", [PriorityClass.INTERACTIVE])
            assert claimed.run.id == run.id
            assert not isinstance(await queue.complete(claimed.lease, {"ok": 1}), Fenced)
            return run.id, claimed.lease.epoch

        # Another tenant's transition: no delivery for acme's endpoint.
        await transition("other")
        assert await scalar(engine, "SELECT count(*) FROM webhook_deliveries") == 0
        # acme's: one, queued in the same statement.
        source, _ = await transition("acme")
        [pending] = await delivery_runs(engine)
        assert pending["source_run_id"] == source
        assert pending["status"] == "queued"
        # A fenced write (a stale epoch) makes none.
        run = await queue.enqueue(
            NewRun(tenant_id="acme", principal="p", agent="scripted", input={})
        )
        [claimed] = await queue.claim("w", [PriorityClass.INTERACTIVE])
        await queue.cancel(run.id, actor="ops")  # one delivery: run.cancelled
        assert isinstance(await queue.complete(claimed.lease, {"late": True}), Fenced)
        events = [r["event"] for r in await delivery_runs(engine)]
        assert events == ["run.succeeded", "run.cancelled"]
        # Deleting the endpoint cancels its pending deliveries; later transitions make none.
        deleted = (await ops.delete(f"/webhooks/{created['id']}")).json()
        assert deleted["cancelled_deliveries"] == 2
        assert {r["status"] for r in await delivery_runs(engine)} == {"cancelled"}
        await transition("acme")
        assert len(await delivery_runs(engine)) == 2
    assert hook.deliveries == []


async def test_cli_webhooks_create_list_enable_delete(database_url: str) -> None:
    env = {"DATABASE_URL": database_url, "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1"}
    code, _, err = await run_cli(
        "webhooks", "create", "--tenant", "acme", "--url", "http://127.0.0.1:9/x", env=env
    )
    assert code == 2
    assert "TURNSTILE_SECRET_KEY" in err
    env["TURNSTILE_SECRET_KEY"] = SECRET_KEY
    code, _, err = await run_cli(
        "webhooks", "create", "--tenant", "acme", "--url", "http://10.1.2.3/x", env=env
    )
    assert code == 2
    assert "not on the allow-list" in err
    code, out, _ = await run_cli(
        "webhooks", "create", "--tenant", "acme", "--url", "http://127.0.0.1:9/x",
        "--events", "run.failed", "--json", env=env,
    )  # fmt: skip
    assert code == 0
    created = json.loads(out)
    assert created["secret"].startswith("whsec_")
    code, out, _ = await run_cli("webhooks", "list", "--tenant", "acme", "--json", env=env)
    assert [w["id"] for w in json.loads(out)] == [created["id"]]
    assert "secret" not in out
    code, out, _ = await run_cli(
        "webhooks", "enable", created["id"], "--tenant", "acme", "--json", env=env
    )
    assert code == 0
    assert json.loads(out)["enabled"] is True
    code, _, err = await run_cli("webhooks", "enable", created["id"], "--tenant", "other", env=env)
    assert code == 2
    assert "not found" in err
    code, out, _ = await run_cli(
        "webhooks", "delete", created["id"], "--tenant", "other", "--json", env=env
    )
    assert code == 2
    code, out, _ = await run_cli(
        "webhooks", "delete", created["id"], "--tenant", "acme", "--json", env=env
    )
    assert code == 0
    assert json.loads(out)["deleted"] is True


async def test_a_worker_killed_mid_delivery_repeats_it_only_with_the_same_webhook_id(
    database_url: str, engine: AsyncEngine
) -> None:
    async with receiver() as hook:
        hook.hold_first = asyncio.Event()
        box = SecretBox(SECRET_KEY)
        queue = Queue(engine)
        _, secret = await register_endpoint(
            Webhooks(queue), HttpRequestTool(["127.0.0.1"]), box,
            tenant_id="acme", principal="ops", url=hook.url, events=[],
        )  # fmt: skip
        run = await queue.enqueue(NewRun(tenant_id="acme", principal="p", agent="s", input={}))
        [claimed] = await queue.claim("test", [PriorityClass.INTERACTIVE])
        await queue.complete(claimed.lease, {"ok": True})  # one delivery, queued
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_SECRET_KEY": SECRET_KEY,
            "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
            "TURNSTILE_LEASE_SECONDS": "2",
            "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_WEBHOOK_BACKOFF_BASE_SECONDS": "0.05",
            "TURNSTILE_WEBHOOK_BACKOFF_MAX_SECONDS": "0.2",
            "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
        }
        async with turnstile("worker", ready=b"running slots", env=env) as first:
            await eventually(lambda: _count(hook, 1), what="the first send", within=30)
            first.process.kill()  # mid-request: the receiver has not answered
            await first.process.wait()
        async with turnstile("worker", ready=b"running slots", env=env):
            [delivery] = await eventually(
                lambda: _all_succeeded(engine, 1), what="the redelivery", within=60
            )
    assert len(hook.deliveries) == 2
    assert {d.id for d in hook.deliveries} == {str(delivery["id"])}
    assert all(hook.verify(secret, d) for d in hook.deliveries)
    assert all(d.json["data"]["run_id"] == str(run.id) for d in hook.deliveries)
    assert await scalar(engine, "SELECT count(*) FROM webhook_deliveries") == 1
