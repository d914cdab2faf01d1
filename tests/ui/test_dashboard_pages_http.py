"""The dashboard's search, schedules, webhooks, keys and charts over plain HTTP (the browser
tests are tests/ui/test_dashboard_pages_browser.py): unknown and malformed ids answered with a
page, never a 500; the operator scope and the key's own tenant for every write; and what
another tenant's key cannot see."""

from __future__ import annotations

from uuid import UUID, uuid4

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.reads import Reads
from app.ui.session import COOKIE, csrf_token
from app.vocabulary.records import NewRun
from tests.support.api import Api, running_api


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
