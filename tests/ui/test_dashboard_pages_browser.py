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
from app.queue.scheduling import NewSchedule, Schedules
from app.queue.webhook_endpoints import Webhooks
from app.security.api_keys import authenticate, create_key
from app.vocabulary.classes import PriorityClass
from tests.support.api import running_api
from tests.support.browser import chromium
from tests.support.clock import ManualClock
from tests.support.servers import running_server
from tests.ui.test_dashboard_browser import failed_run, recovered_run, sign_in

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


async def test_operator_pauses_a_schedule_disables_a_webhook_and_revokes_a_key(
    database_url: str, engine: AsyncEngine, clocked: tuple[Queue, ManualClock]
) -> None:
    queue, _ = clocked
    schedules = Schedules(queue)
    schedule = await schedules.create(
        NewSchedule(
            tenant_id="acme",
            principal="ops",
            cron="*/15 * * * *",
            agent="scripted",
            input={"script": [{"final": "tick"}]},
            priority=PriorityClass.ASYNC.base,
        )
    )
    webhooks = Webhooks(queue)
    endpoint = await webhooks.create(
        tenant_id="acme",
        principal="ops",
        url="https://hooks.example/turnstile",
        events=[],
        secret=b"ciphertext, never read by the page",
    )
    reported = await failed_run(queue)  # its run.failed is delivered to the endpoint
    for _ in range(2):
        await webhooks.delivery_failed(endpoint.id)
    async with running_api(database_url, engine) as api, chromium() as browser:
        alice = await create_key(engine, tenant_id="acme", principal="alice", name="alice's")
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "ops", "operator"))

        # Schedules: cron, next fires, the tick queued ahead, pause and resume.
        await page.get_by_role("link", name="Schedules").click()
        row = page.locator(f'tr[data-schedule="{schedule.id}"]')
        await expect(row.get_by_test_id("cron")).to_have_text("*/15 * * * *")
        await expect(row.get_by_test_id("schedule-state")).to_have_text("active")
        await expect(row.get_by_test_id("next-fires").locator("li")).to_have_count(3)
        await expect(row.get_by_test_id("recent-runs")).to_contain_text("queued")
        await browser.screenshot(page, "ui-schedules")
        await row.get_by_role("button", name="Pause").click()
        await expect(page.get_by_test_id("notice")).to_contain_text(
            f"Paused schedule {schedule.id}"
        )
        await expect(row.get_by_test_id("schedule-state")).to_have_text("paused")
        await expect(row.get_by_test_id("next-fires")).to_have_text("none while paused")
        assert (await schedules.get(schedule.id, tenant_id="acme")).paused_at is not None
        await row.get_by_role("button", name="Resume").click()
        await expect(page.get_by_test_id("notice")).to_contain_text(
            f"Resumed schedule {schedule.id}"
        )
        await expect(row.get_by_test_id("schedule-state")).to_have_text("active")
        await expect(row.get_by_test_id("next-fires").locator("li")).to_have_count(3)

        # Webhook endpoints: deliveries, failures in a row, disable and enable.
        await page.get_by_role("link", name="Webhooks").click()
        card = page.locator(f'section[data-webhook="{endpoint.id}"]')
        await expect(card.get_by_test_id("webhook-state")).to_have_text("enabled")
        await expect(card.get_by_test_id("consecutive-failures")).to_have_text("2")
        deliveries = card.get_by_test_id("deliveries").locator("tr[data-delivery]")
        await expect(deliveries).to_have_count(1)
        await expect(deliveries.first).to_contain_text("run.failed")
        await expect(deliveries.first).to_contain_text(str(reported))
        await expect(card.get_by_test_id("delivery-counts")).to_have_text(
            "0 delivered, 0 failed, 1 pending"
        )
        await browser.screenshot(page, "ui-webhooks")
        await card.get_by_role("button", name="Disable").click()
        await expect(page.get_by_test_id("notice")).to_contain_text("Disabled webhook endpoint")
        await expect(card.get_by_test_id("webhook-state")).to_have_text("disabled")
        assert (await webhooks.list("acme"))[0].disabled_at is not None
        await card.get_by_role("button", name="Enable").click()
        await expect(card.get_by_test_id("webhook-state")).to_have_text("enabled")
        await expect(card.get_by_test_id("consecutive-failures")).to_have_text("0")

        # API keys: the list, and a revocation that takes effect at once.
        await page.get_by_role("link", name="API keys").click()
        key_row = page.locator(f'tr[data-key="{alice.info.id}"]')
        await expect(key_row).to_contain_text("acme / alice")
        await expect(key_row.get_by_test_id("key-state")).to_contain_text("active")
        await browser.screenshot(page, "ui-keys")
        await key_row.get_by_role("button", name="Revoke").click()
        await expect(page.get_by_test_id("notice")).to_contain_text(f"Revoked key {alice.info.id}")
        await expect(key_row.get_by_test_id("key-state")).to_contain_text("revoked")
        await expect(key_row.get_by_role("button", name="Revoke")).to_have_count(0)
        assert await authenticate(engine, alice.secret) is None
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console


async def test_the_overview_draws_charts_of_the_last_hour_with_nothing_fetched(
    database_url: str, engine: AsyncEngine, clocked: tuple[Queue, ManualClock]
) -> None:
    queue, _ = clocked
    await failed_run(queue)  # claimed and finished a moment ago: within the hour
    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "ops", "operator"))
        throughput = page.get_by_test_id("chart-throughput")
        await expect(throughput).to_have_attribute("data-minutes", "60")
        await expect(throughput).to_have_attribute("data-max", "1")
        await expect(throughput.locator("rect.bar")).to_have_count(1)
        await expect(throughput.locator("rect.bar title")).to_contain_text("1 finished")
        latency = page.get_by_test_id("chart-latency")
        await expect(latency.locator("circle.point")).to_have_count(2)  # its median and max
        await expect(page.get_by_test_id("chart-depth")).to_have_attribute("data-minutes", "60")
        # Drawn, and coloured by the stylesheet (the policy allows no inline styles).
        box = await throughput.bounding_box()
        assert box is not None
        assert box["width"] > 300
        fill = await throughput.locator("rect.bar").evaluate("el => getComputedStyle(el).fill")
        assert fill not in ("rgb(0, 0, 0)", "none"), fill
        await browser.screenshot(page, "ui-overview-charts")
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console
