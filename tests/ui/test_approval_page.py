"""The dashboard's run page shows the tool call a run waits to have approved (docs/approvals.md):
the tool, its class, its call id and its arguments, and how to answer."""

from __future__ import annotations

import html
from uuid import UUID

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.waiting import eventually


async def test_the_run_page_shows_the_pending_approval(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        body = {
            "input": {"script": [{"call": "echo", "args": {"to": "ada"}}, {"final": "ok"}]},
            "approval": {"tools": ["echo"]},
        }
        run_id = (await client.post("/runs", json=body)).json()["id"]

        async def request() -> dict[str, object] | None:
            run = await api.queue.get_run(UUID(run_id))
            assert run is not None
            found = run.approval_request
            return found if isinstance(found, dict) else None

        pending = await eventually(request, within=30, what="the approval request")
        browser = httpx.AsyncClient(base_url=api.base, timeout=30)
        api.clients.append(browser)
        signed = await browser.post("/ui/sign-in", data={"key": await api.key()})
        assert signed.status_code == 303
        page = await browser.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200
        text = html.unescape(page.text)
        assert "Waiting for approval of a tool call" in text
        assert str(pending["call_id"]) in text
        assert '"to": "ada"' in text
        assert "Question to the user" not in text
