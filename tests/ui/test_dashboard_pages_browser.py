"""The dashboard's search, step durations, schedules, webhooks, keys and charts in a real
browser (Debian's headless Chromium through Playwright, every request outside 127.0.0.1
blocked), against a real API server and PostgreSQL, as tests/ui/test_dashboard_browser.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from uuid import uuid4

import pytest
from fastapi import FastAPI
from playwright.async_api import expect
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue, QueueConfig
from app.queue.reads import Reads
from tests.support.api import running_api
from tests.support.browser import chromium
from tests.support.clock import ManualClock
from tests.support.servers import running_server
from tests.ui.test_dashboard_browser import recovered_run, sign_in

pytestmark = pytest.mark.system


@pytest.fixture
async def clocked(engine: AsyncEngine) -> tuple[Queue, ManualClock]:
    clock = ManualClock(datetime.now(UTC))
    config = QueueConfig(
        lease_seconds=30, max_attempts=3, backoff_base_seconds=5, backoff_max_seconds=300
    )
    return Queue(engine, config, clock=clock), clock


@pytest.fixture
async def payments() -> AsyncIterator[tuple[FastAPI, str]]:
    """A loopback 'payment service' the unsafe tool call reaches."""
    app = FastAPI()
    async with running_server(app) as base:
        yield app, base


async def test_search_finds_a_run_and_its_timeline_shows_step_and_tool_durations(
    database_url: str,
    engine: AsyncEngine,
    clocked: tuple[Queue, ManualClock],
    payments: tuple[FastAPI, str],
) -> None:
    queue, clock = clocked
    run_id = await recovered_run(queue, clock, payments)
    session = await Reads(queue).create_session(tenant_id="acme", principal="alice")
    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "ops", "operator"))
        search = page.get_by_role("searchbox", name="Run or session id")
        await search.fill(str(run_id))
        await search.press("Enter")
        await expect(page).to_have_url(f"{api.base}/ui/runs/{run_id}")
        timeline = page.get_by_test_id("timeline")
        # The recovered run's clock: the lease expired 31 s into the call, the second worker
        # claimed an hour later and recorded the call's outcome as uncertain at once.
        await expect(timeline.locator("li").first.locator(".since")).to_have_text("")
        requeued = timeline.locator('li[data-type="run.requeued"]')
        await expect(requeued.locator(".since")).to_have_text("+31.0 s")
        finished = timeline.locator('li[data-type="tool.finished"]')
        await expect(finished.locator(".took")).to_have_text(
            "· took 60.5 min, recorded at epoch 2 after the call at 1"
        )
        await browser.screenshot(page, "ui-run-durations")

        # A session id goes to its page; an unknown id to a clear "not found" page.
        await search.fill(str(session.id))
        await search.press("Enter")
        await expect(page).to_have_url(f"{api.base}/ui/sessions/{session.id}")
        unknown = uuid4()
        await search.fill(str(unknown))
        await search.press("Enter")
        await expect(page.get_by_test_id("error")).to_contain_text(
            f"Not found: no run or session '{unknown}' is visible to this key."
        )
        await expect(search).to_have_value(str(unknown))
        await browser.screenshot(page, "ui-search-not-found")
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console
