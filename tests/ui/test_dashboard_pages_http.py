"""The dashboard's search, schedules, webhooks, keys and charts over plain HTTP (the browser
tests are tests/ui/test_dashboard_pages_browser.py): unknown and malformed ids answered with a
page, never a 500; the operator scope and the key's own tenant for every write; and what
another tenant's key cannot see."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from uuid import UUID, uuid4

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.queue.reads import Reads
from app.queue.scheduling import NewSchedule, Schedules
from app.queue.webhook_endpoints import Webhooks
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, default_registry
from app.security.api_keys import active_keys, create_key, list_keys
from app.ui import views
from app.ui.session import COOKIE, csrf_token
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.runtime import execute_once


async def signed_in(api: Api, key: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=api.base, timeout=30)
    api.clients.append(client)
    response = await client.post("/ui/sign-in", data={"key": key})
    assert response.status_code == 303, response.text
    return client


def csrf_of(client: httpx.AsyncClient) -> str:
    return csrf_token(client.cookies[COOKIE])


async def a_run(api: Api, tenant: str = "acme", principal: str = "alice") -> UUID:
    run = await api.queue.enqueue(
        NewRun(tenant_id=tenant, principal=principal, agent="scripted", input={"text": "hi"})
    )
    return run.id


async def test_search_goes_to_a_run_or_a_session_and_says_not_found_otherwise(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        ours = await a_run(api)
        theirs = await a_run(api, "globex")
        session = await Reads(api.queue).create_session(tenant_id="acme", principal="alice")
        alice = await signed_in(api, await api.key("acme", "alice"))

        found = await alice.get("/ui/search", params={"q": f"  {ours}  "})
        assert found.status_code == 303
        assert found.headers["location"] == f"/ui/runs/{ours}"
        # Upper case is the same UUID.
        found = await alice.get("/ui/search", params={"q": str(session.id).upper()})
        assert found.status_code == 303
        assert found.headers["location"] == f"/ui/sessions/{session.id}"

        unknown = uuid4()
        missing = await alice.get("/ui/search", params={"q": str(unknown)})
        assert missing.status_code == 404
        assert f"Not found: no run or session &#39;{unknown}&#39;" in missing.text
        assert f'value="{unknown}"' in missing.text  # the box keeps what was typed
        # Another tenant's run is not found either: a search reveals no more than the pages.
        hidden = await alice.get("/ui/search", params={"q": str(theirs)})
        assert hidden.status_code == 404
        assert "Not found" in hidden.text

        for bad in ("not-an-id", "<script>alert(1)</script>", "x" * 500, "\uff11\uff12\uff13"):
            response = await alice.get("/ui/search", params={"q": bad})
            assert response.status_code == 400, bad
            assert "is not a run or session id" in response.text
            assert "<script>alert" not in response.text
        empty = await alice.get("/ui/search", params={"q": " "})
        assert empty.status_code == 400
        assert "Type a run id or a session id" in empty.text
        assert (await alice.get("/ui/search")).status_code == 400

        # Signed out: to the sign-in form, coming back to the search afterwards.
        anonymous = httpx.AsyncClient(base_url=api.base)
        api.clients.append(anonymous)
        response = await anonymous.get("/ui/search", params={"q": str(ours)})
        assert response.status_code == 303
        assert response.headers["location"].startswith("/ui/sign-in?next=%2Fui%2Fsearch")


def nightly(tenant: str = "acme") -> NewSchedule:
    return NewSchedule(
        tenant_id=tenant,
        principal="ops",
        cron="0 3 * * *",
        agent="scripted",
        input={"script": [{"final": "tick"}]},
        priority=PriorityClass.ASYNC.base,
    )


async def test_schedule_webhook_and_key_pages_need_the_operator_scope_and_act_in_its_tenant(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        schedules = Schedules(api.queue)
        ours = await schedules.create(nightly("acme"))
        theirs = await schedules.create(nightly("globex"))
        webhooks = Webhooks(api.queue)
        endpoint = await webhooks.create(
            tenant_id="globex",
            principal="ops",
            url="https://hooks.example/x",
            events=[],
            secret=b"not read here",
        )
        globex_key = (await create_key(engine, tenant_id="globex", principal="bob")).info
        admin_key = (
            await create_key(engine, tenant_id="acme", principal="root", scopes=("admin",))
        ).info

        # A key without a scope: no page, no write (with its own valid CSRF token).
        alice = await signed_in(api, await api.key("acme", "alice"))
        for path in ("/ui/schedules", "/ui/webhooks", "/ui/keys"):
            response = await alice.get(path)
            assert response.status_code == 403, path
            assert "need the operator scope" in response.text
        writes = (
            f"/ui/schedules/{ours.id}/pause",
            f"/ui/webhooks/{endpoint.id}/disable",
            f"/ui/keys/{globex_key.id}/revoke",
        )
        for path in writes:
            response = await alice.post(path, data={"csrf": csrf_of(alice)})
            assert response.status_code == 403, path
            assert "needs a key with the operator scope" in response.text

        # An operator: a forged or missing CSRF token, or another site's form, is refused.
        ops = await signed_in(api, await api.key("acme", "ops", "operator"))
        path = f"/ui/schedules/{ours.id}/pause"
        assert (await ops.post(path, data={"csrf": "forged"})).status_code == 403
        assert (await ops.post(path, data={"other": "x"})).status_code == 403
        cross = await ops.post(
            path, data={"csrf": csrf_of(ops)}, headers={"Origin": "https://evil.example"}
        )
        assert cross.status_code == 403
        assert (await schedules.get(ours.id, tenant_id=None)).state == "active"

        # Its own tenant's schedule pauses and resumes; another tenant's is not found.
        paused = await ops.post(path, data={"csrf": csrf_of(ops)})
        assert paused.status_code == 303
        assert paused.headers["location"] == f"/ui/schedules?done=paused&id={ours.id}"
        assert (await schedules.get(ours.id, tenant_id=None)).state == "paused"
        page = await ops.get(paused.headers["location"])
        assert f"Paused schedule {ours.id}" in page.text
        assert str(theirs.id) not in page.text  # an operator sees its own tenant's only
        resumed = await ops.post(f"/ui/schedules/{ours.id}/resume", data={"csrf": csrf_of(ops)})
        assert resumed.headers["location"] == f"/ui/schedules?done=resumed&id={ours.id}"
        assert (await schedules.get(ours.id, tenant_id=None)).state == "active"
        for target in (theirs.id, uuid4(), "not-a-uuid"):
            response = await ops.post(f"/ui/schedules/{target}/pause", data={"csrf": csrf_of(ops)})
            assert response.status_code == 303
            assert "done=not-found" in response.headers["location"]
            shown = await ops.get(response.headers["location"])
            assert shown.status_code == 200
            assert "is not visible to this key" in shown.text
        assert (await schedules.get(theirs.id, tenant_id=None)).state == "active"

        # Another tenant's endpoint and key are out of reach, an admin key of its own tenant
        # too for an operator.
        response = await ops.post(
            f"/ui/webhooks/{endpoint.id}/disable", data={"csrf": csrf_of(ops)}
        )
        assert "done=not-found" in response.headers["location"]
        assert (await webhooks.list("globex"))[0].disabled_at is None
        response = await ops.post(f"/ui/keys/{globex_key.id}/revoke", data={"csrf": csrf_of(ops)})
        assert "done=not-found" in response.headers["location"]
        response = await ops.post(f"/ui/keys/{admin_key.id}/revoke", data={"csrf": csrf_of(ops)})
        assert "done=admin-key" in response.headers["location"]
        assert {k.id for k in await list_keys(engine) if k.revoked_at is not None} == set()
        keys = await ops.get("/ui/keys")
        assert str(globex_key.id) not in keys.text
        assert str(admin_key.id) in keys.text

        # An admin key reads every tenant's, and still writes only in its own.
        root = await signed_in(api, await api.key("acme", "root2", "admin"))
        every = await root.get("/ui/schedules")
        assert str(theirs.id) in every.text
        assert "another tenant's" in every.text
        assert str(endpoint.id) in (await root.get("/ui/webhooks")).text
        assert str(globex_key.id) in (await root.get("/ui/keys")).text
        response = await root.post(f"/ui/schedules/{theirs.id}/pause", data={"csrf": csrf_of(root)})
        assert "done=not-found" in response.headers["location"]
        response = await root.post(f"/ui/keys/{admin_key.id}/revoke", data={"csrf": csrf_of(root)})
        assert response.headers["location"] == f"/ui/keys?done=revoked&id={admin_key.id}"
        assert await authenticate_id(engine, admin_key.id) is False

        # A bad cursor is a page saying so.
        bad = await ops.get("/ui/schedules", params={"cursor": "garbage!"})
        assert bad.status_code == 400
        assert "cursor: not a link this dashboard made" in bad.text


async def authenticate_id(engine: AsyncEngine, key_id: UUID) -> bool:
    """Whether the key is still unrevoked."""
    return key_id in await active_keys(engine, {key_id})


async def test_the_charts_minutes_count_finished_claimed_latency_and_depth(
    engine: AsyncEngine,
) -> None:
    clock = ManualClock(datetime(2030, 1, 1, 12, 0, 10, tzinfo=UTC))
    queue = Queue(engine, clock=clock)
    for _ in range(2):
        await queue.enqueue(
            NewRun(
                tenant_id="acme",
                principal="alice",
                agent="scripted",
                input={"script": [{"final": "done"}]},
            )
        )
    clock.advance(60)  # 12:01:10: one of them is claimed and finishes, a minute after it came
    runtime = RuntimeExecutor(default_registry(["127.0.0.1"]), RuntimeLimits())
    await execute_once(queue, runtime, owner="worker-a")
    clock.advance(60)  # 12:02:10
    minutes = await Reads(queue).minutes(tenant_id="acme", minutes=5)
    assert [m.start.strftime("%H:%M") for m in minutes] == [
        "11:58", "11:59", "12:00", "12:01", "12:02",
    ]  # fmt: skip
    assert [m.depth for m in minutes] == [0, 0, 2, 1, 1]  # at each minute's end (now: 12:02:10)
    assert [m.finished for m in minutes] == [0, 0, 0, 1, 0]
    assert [m.claimed for m in minutes] == [0, 0, 0, 1, 0]
    assert minutes[3].latency_median == minutes[3].latency_max == 60.0
    assert minutes[2].latency_median is None
    assert await Reads(queue).minutes(tenant_id="globex", minutes=5) == [
        replace(m, depth=0, finished=0, claimed=0, latency_median=None, latency_max=None)
        for m in minutes
    ]

    svg = str(views.charts(minutes)[0][1])
    assert svg.startswith('<svg class="chart"')
    assert svg.count("<rect") == 1
    assert "12:01 UTC: 1 finished" in svg
    assert 'data-minutes="5"' in svg
    latency = str(views.charts(minutes)[2][1])
    assert "median: latest 60.0 s" in latency
    assert "<script" not in svg + latency
    assert "style=" not in svg + latency
