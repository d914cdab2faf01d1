"""The dashboard over plain HTTP (the browser tests are tests/ui/test_dashboard_browser.py): the
session cookie's attributes, CSRF and cross-site refusals, bad input answered with a page and
never a traceback, escaping, tenant scoping, and the timeline's wording of events."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import authenticate, revoke_key
from app.ui import views
from app.ui.session import COOKIE, csrf_token
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Event, NewRun
from tests.support.api import Api, running_api
from tests.support.waiting import eventually


async def signed_in(api: Api, key: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=api.base, timeout=30)
    api.clients.append(client)
    response = await client.post("/ui/sign-in", data={"key": key})
    assert response.status_code == 303, response.text
    return client


def enqueue(tenant: str = "acme", **fields: Any) -> NewRun:
    return NewRun(
        tenant_id=tenant,
        principal=fields.pop("principal", "alice"),
        agent="scripted",
        input=fields.pop("input", {"text": "hi"}),
        priority=fields.pop("priority", PriorityClass.INTERACTIVE.base),
        **fields,
    )


async def test_sign_in_sets_a_browser_session_cookie(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        key = await api.key("acme", "ops", "operator")
        async with httpx.AsyncClient(base_url=api.base) as client:
            bad = await client.post("/ui/sign-in", data={"key": "ts_not-a-key"})
            assert bad.status_code == 401
            assert "Unknown or revoked API key" in bad.text
            assert COOKIE not in bad.cookies

            response = await client.post(
                "/ui/sign-in", data={"key": key, "next": "https://evil.example/"}
            )
            assert response.status_code == 303
            assert response.headers["location"] == "/ui"  # never off-site
            cookie = response.headers["set-cookie"]
            assert cookie.startswith(f"{COOKIE}=")
            attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
            assert {"httponly", "path", "samesite"} <= attributes
            assert "samesite=strict" in cookie.lower()
            assert "max-age" not in attributes
            assert "expires" not in attributes
            assert "path=/ui" in cookie.lower()

            page = await client.get("/ui")
            assert page.status_code == 200
            assert "default-src 'self'" in page.headers["content-security-policy"]
            assert "acme/ops" in page.text

            token = client.cookies[COOKIE]
            signed_out = await client.post("/ui/sign-out", data={"csrf": csrf_token(token)})
            assert signed_out.status_code == 303
            client.cookies.clear()
            again = await client.get("/ui/runs?status=failed")
            assert again.status_code == 303
            assert again.headers["location"] == "/ui/sign-in?next=%2Fui%2Fruns%3Fstatus%3Dfailed"
            fragment = await client.get("/ui/overview/fragment")
            assert fragment.status_code == 401


async def test_the_cookie_is_an_opaque_session_that_sign_out_and_revocation_end(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        key = await api.key("acme", "ops", "operator")
        caller = await authenticate(engine, key)
        assert caller is not None
        key_id = caller.key_id
        client = await signed_in(api, key)
        token = client.cookies[COOKIE]
        assert key not in token  # the cookie holds no key
        async with engine.connect() as conn:
            stored = (await conn.execute(text("SELECT * FROM dashboard_sessions"))).mappings().all()
        # Only a hash of the token is stored, with the key it belongs to and an expiry.
        assert [row["token_hash"] for row in stored] == [hashlib.sha256(token.encode()).digest()]
        assert all(token not in str(value) for value in stored[0].values())
        assert stored[0]["key_id"] == key_id
        assert stored[0]["expires_at"] > stored[0]["created_at"]

        # A copy of the cookie, as a thief would keep it, stops working once its owner signs out.
        copy = httpx.AsyncClient(base_url=api.base, cookies={COOKIE: token})
        api.clients.append(copy)
        assert (await copy.get("/ui/runs")).status_code == 200
        signed_out = await client.post("/ui/sign-out", data={"csrf": csrf_token(token)})
        assert signed_out.status_code == 303
        assert (await copy.get("/ui/runs")).status_code == 303
        assert (await copy.get("/ui/overview/fragment")).status_code == 401

        # Revoking the key ends its sessions at once (no cache to wait for).
        again = await signed_in(api, key)
        assert (await again.get("/ui/runs")).status_code == 200
        assert await revoke_key(engine, key_id)
        assert (await again.get("/ui/runs")).status_code == 303
        async with engine.connect() as conn:
            left = await conn.scalar(text("SELECT count(*) FROM dashboard_sessions"))
        assert left == 0

        # An expired session is refused too.
        other = await signed_in(api, await api.key("acme", "ops2", "operator"))
        assert (await other.get("/ui/runs")).status_code == 200
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE dashboard_sessions SET expires_at = now() - interval '1 second'")
            )
        assert (await other.get("/ui/runs")).status_code == 303


async def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(
    database_url: str, engine: AsyncEngine
) -> None:
    forwarded = {"X-Forwarded-Proto": "https"}
    for trusted in (True, False):
        async with running_api(database_url, engine, trust_forwarded_headers=trusted) as api:
            key = await api.key("acme", "ops", "operator")
            async with httpx.AsyncClient(base_url=api.base) as client:
                response = await client.post("/ui/sign-in", data={"key": key}, headers=forwarded)
                assert response.status_code == 303
                attributes = {
                    part.strip().lower() for part in response.headers["set-cookie"].split(";")
                }
                assert ("secure" in attributes) is trusted


async def test_actions_need_the_csrf_token_and_the_same_origin(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        key = await api.key("acme", "ops", "operator")
        client = await signed_in(api, key)
        token = client.cookies[COOKIE]
        run_id = uuid4()
        missing = await client.post(f"/ui/runs/{run_id}/dismiss", data={"back": "/ui"})
        assert missing.status_code == 403
        assert "CSRF" in missing.text
        forged = await client.post(
            f"/ui/runs/{run_id}/dismiss",
            data={"csrf": csrf_token(token)},
            headers={"Origin": "https://evil.example"},
        )
        assert forged.status_code == 403
        assert "another site" in forged.text
        not_a_form = await client.post(
            f"/ui/runs/{run_id}/dismiss", json={"csrf": csrf_token(token)}
        )
        assert not_a_form.status_code == 415
        # With the token: the core answers, as a notice on the page it redirects to.
        ok = await client.post(f"/ui/runs/{run_id}/dismiss", data={"csrf": csrf_token(token)})
        assert ok.status_code == 303
        assert "notice=not-found" in ok.headers["location"]
        page = await client.get(ok.headers["location"])
        assert f"Run {run_id} is not visible to this key." in page.text


async def test_bad_input_is_a_clear_page_never_a_traceback(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        client = await signed_in(api, await api.key("acme", "ops", "operator"))
        for query, message in [
            ("status=exploded", "status: 'exploded' is not one of"),
            ("class=urgent", "class: 'urgent' is not one of"),
            ("session=nope", "session: 'nope' is not a session id"),
            ("since=yesterday", "since: 'yesterday' is not a time"),
            ("since=2030-01-02T00:00&until=2030-01-01T00:00", "since must be earlier"),
            # Issue 40, item 7: times that fall outside Python's range once in UTC.
            ("since=0001-01-01T00:00:00%2B14:00", "since: '0001-01-01T00:00:00+14:00' is out"),
            ("until=9999-12-31T23:59:59-12:00", "until: '9999-12-31T23:59:59-12:00' is out"),
        ]:
            response = await client.get(f"/ui/runs?{query}")
            assert response.status_code == 400, query
            assert message in response.text.replace("&#39;", "'"), query
        bad_cursor = await client.get("/ui/runs?cursor=%%%")
        assert bad_cursor.status_code == 400
        assert "cursor" in bad_cursor.text
        for path in ("/ui/runs/not-a-uuid", f"/ui/runs/{uuid4()}"):
            missing = await client.get(path)
            assert missing.status_code == 404
            assert "is visible to this key" in missing.text
        assert (await client.get("/ui/dead-letter?cursor=zzz")).status_code == 400
        # Digits outside ASCII pass str.isdigit() but not int(): a page, never a 500.
        run = await api.queue.enqueue(enqueue("acme"))
        for after in ("²", "³", "①", "٣", "-1", "1e3", " 7", "9" * 30):
            page = await client.get(f"/ui/runs/{run.id}", params={"after": after})
            assert page.status_code == 200, after
            assert "run.created" in page.text, after
        assert (await client.get("/ui/runs?" + "status=x" * 3000)).status_code in (400, 414)


async def test_pages_escape_what_tenants_wrote(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        client = await signed_in(api, await api.key("acme", "ops", "operator"))
        evil = "<script>alert(1)</script>"
        run = await api.queue.enqueue(enqueue(input={"text": evil}))
        page = await client.get(f"/ui/runs/{run.id}")
        assert page.status_code == 200
        assert evil not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


async def test_tenant_scoping_follows_the_api(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        ours = await api.queue.enqueue(enqueue("acme"))
        theirs = await api.queue.enqueue(enqueue("globex"))
        reader = await signed_in(api, await api.key("acme", "alice"))
        listing = (await reader.get("/ui/runs")).text
        assert str(ours.id) in listing
        assert str(theirs.id) not in listing
        assert (await reader.get(f"/ui/runs/{theirs.id}")).status_code == 404
        assert (await reader.get(f"/ui/runs/{ours.id}")).status_code == 200
        # The runbook views need the operator scope, as in the API.
        landing = await reader.get("/ui")
        assert landing.status_code == 303
        assert landing.headers["location"] == "/ui/runs"
        assert (await reader.get("/ui/dead-letter")).status_code == 403
        assert (await reader.get("/ui/overview/fragment")).status_code == 403
        # Within the tenant, a key without a scope sees its own principal's runs only.
        carols = await api.queue.enqueue(enqueue("acme", principal="carol"))
        assert str(carols.id) not in (await reader.get("/ui/runs")).text
        assert (await reader.get(f"/ui/runs/{carols.id}")).status_code == 404
        ops = await signed_in(api, await api.key("acme", "ops", "operator"))
        assert str(carols.id) in (await ops.get("/ui/runs")).text

        admin = await signed_in(api, await api.key("platform", "root", "admin"))
        listing = (await admin.get("/ui/runs")).text
        assert str(ours.id) in listing
        assert str(theirs.id) in listing
        assert (await admin.get(f"/ui/runs/{theirs.id}")).status_code == 200
        overview = await admin.get("/ui")
        assert "whole queue" in overview.text


async def test_an_admin_reads_only_its_own_tenants_sessions_as_in_the_api(
    database_url: str, engine: AsyncEngine
) -> None:
    """Issue 40, item 9: the scope table gives admin keys any run, but sessions of their own
    tenant only; the dashboard's session page answered 200 where the API answers 404."""
    async with running_api(database_url, engine) as api:
        alice = await api.client("acme", "alice")
        session = (await alice.post("/sessions")).json()["id"]
        said = "a private word of acme"
        turn = await alice.post(f"/sessions/{session}/turns", json={"input": {"text": said}})
        run = turn.json()["id"]
        admin_key = await api.key("platform", "root", "admin")
        admin_api = httpx.AsyncClient(
            base_url=api.base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
        )
        api.clients.append(admin_api)
        assert (await admin_api.get(f"/sessions/{session}")).status_code == 404
        admin = await signed_in(api, admin_key)
        page = await admin.get(f"/ui/sessions/{session}")
        assert page.status_code == 404, page.text
        assert "is visible to this key" in page.text
        assert said not in page.text
        # Its runs stay readable, as in the API, without a link to the session it cannot open.
        run_page = await admin.get(f"/ui/runs/{run}")
        assert run_page.status_code == 200
        assert f'href="/ui/sessions/{session}"' not in run_page.text
        assert f'href="/ui/sessions/{session}"' not in (await admin.get("/ui/runs")).text
        # The tenant's own operator reads the session, with the links.
        ops = await signed_in(api, await api.key("acme", "ops", "operator"))
        assert (await ops.get(f"/ui/sessions/{session}")).status_code == 200
        assert f'href="/ui/sessions/{session}"' in (await ops.get(f"/ui/runs/{run}")).text
        # And an admin of the session's own tenant reads it too.
        own_admin = await signed_in(api, await api.key("acme", "root", "admin"))
        assert (await own_admin.get(f"/ui/sessions/{session}")).status_code == 200


async def test_the_runs_list_filters_and_pages(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        client = await signed_in(api, await api.key("acme", "ops", "operator"))
        interactive = [await api.queue.enqueue(enqueue()) for _ in range(53)]
        batch = await api.queue.enqueue(enqueue(priority=PriorityClass.ASYNC.base))
        first = await client.get("/ui/runs?class=interactive")
        shown = re.findall(r'data-run="([0-9a-f-]+)"', first.text)
        assert len(shown) == 50
        assert shown[0] == str(interactive[-1].id)  # newest first
        assert str(batch.id) not in shown
        more = re.search(r'href="(/ui/runs\?[^"]+)" rel="next"', first.text)
        assert more is not None
        second = await client.get(more.group(1).replace("&amp;", "&"))
        rest = re.findall(r'data-run="([0-9a-f-]+)"', second.text)
        assert rest == [str(r.id) for r in reversed(interactive[:3])]
        only_async = await client.get("/ui/runs?class=async&status=queued")
        assert re.findall(r'data-run="([0-9a-f-]+)"', only_async.text) == [str(batch.id)]
        future = await client.get("/ui/runs?since=2999-01-01T00:00")
        assert re.findall(r'data-run="([0-9a-f-]+)"', future.text) == []


def test_the_timeline_words_recovery_events() -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    events = [
        Event(2, "run.claimed", 1, {"attempt": 1, "owner": "w1"}, at),
        Event(
            5,
            "tool.finished",
            2,
            {
                "step": 1,
                "tool": "pay",
                "idempotency_class": "unsafe",
                "outcome_status": "uncertain",
            },
            at,
        ),
        Event(
            6,
            "run.fenced",
            1,
            {"stale_epoch": 1, "current_epoch": 2, "during": "heartbeat", "owner": "w1"},
            at,
        ),
        Event(7, "run.requeued", 1, {"reason": "lease_expired", "attempts": 1}, at),
        Event(8, "something.new", 2, {"x": 1}, at),
    ]
    claimed, uncertain, fenced, requeued, unknown = views.timeline(events, {})
    assert claimed.title == "claimed at epoch 1, attempt 1"
    assert "uncertain" in uncertain.tags
    assert "outcome unknown" in uncertain.title
    assert fenced.title.startswith("heartbeat lost: fenced: a worker at stale epoch 1")
    assert "fence" in fenced.tags
    assert "requeue" in requeued.tags
    assert unknown.title == "something.new"
    assert '"x": 1' in unknown.data


async def test_a_runs_page_shows_its_question_and_the_answer(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client("acme", "alice")
        session = (await client.post("/sessions")).json()["id"]
        script = {"script": [{"ask": "Which account?"}, {"final": "booked"}]}
        run_id = (await client.post(f"/sessions/{session}/turns", json={"input": script})).json()[
            "id"
        ]

        async def reaches(status: str) -> bool:
            run = (
                await client.get(f"/runs/{run_id}", params={"wait": 5, "status": "queued"})
            ).json()
            return bool(run["status"] == status)

        await eventually(lambda: reaches("waiting_for_user"), within=20, what="the question")
        browser = await signed_in(api, await api.key("acme", "ops", "operator"))
        waiting = (await browser.get(f"/ui/runs/{run_id}")).text
        assert "Question to the user" in waiting
        await client.post(f"/sessions/{session}/turns", json={"input": "acct-42"})
        await eventually(lambda: reaches("succeeded"), within=20, what="the answer's run")
        page = (await browser.get(f"/ui/runs/{run_id}")).text
        assert "asked the user: &#34;Which account?&#34;" in page
        assert "answer 2 from alice" in page
        assert "&#34;acct-42&#34;" in page
        assert page.count('data-type="run.claimed"') == 2
        overview = await browser.get("/ui/overview/fragment")
        assert overview.status_code == 200
        assert 'data-group="interactive"' in overview.text  # this process's live slot groups
