"""The dashboard in a real browser (Debian's headless Chromium through Playwright) against a
real API server and PostgreSQL, with every request outside 127.0.0.1 blocked.

The run whose timeline the tests read is recovered for real: a worker's lease expires while
its unsafe tool call is in flight, the sweeper requeues the run, a second worker claims it at
a new epoch and records the call as `uncertain` (it may have happened, so it is not repeated),
and when the first worker's call returns, its write is fenced and it records `run.fenced`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from uuid import UUID

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from playwright.async_api import Page, expect
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue, QueueConfig
from app.queue.reads import Reads
from app.queue.submit import RunSpec, Submissions, Submitter
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, default_registry
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import Api, running_api
from tests.support.browser import chromium
from tests.support.clock import ManualClock
from tests.support.runtime import current, execute_once
from tests.support.servers import running_server

pytestmark = pytest.mark.system


def runtime() -> RuntimeExecutor:
    return RuntimeExecutor(
        default_registry(["127.0.0.1"], http_timeout_seconds=10),
        RuntimeLimits(retry_backoff_seconds=0.01),
    )


async def execute(queue: Queue, owner: str) -> None:
    """Claim the next run as worker `owner` and execute it to its next resting point (a fenced
    execution records run.fenced and stops, as in the pool)."""
    await execute_once(queue, runtime(), owner=owner)


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


async def recovered_run(queue: Queue, clock: ManualClock, payments: tuple[FastAPI, str]) -> UUID:
    """A run recovered from a lost lease in the middle of an unsafe tool call (see above)."""
    app, base = payments
    run = await queue.enqueue(
        NewRun(
            tenant_id="acme",
            principal="alice",
            agent="scripted",
            input={
                "script": [
                    {"call": "http_request", "args": {"method": "POST", "url": f"{base}/pay"}},
                    {"final": "payment attempted once"},
                ]
            },
        )
    )
    hits: list[str] = []

    @app.post("/pay")
    async def pay() -> JSONResponse:
        hits.append("pay")
        # While worker-a waits for this answer, its lease expires: the sweeper requeues the
        # run and worker-b recovers it to the end.
        clock.advance(31)
        assert (await queue.sweep()).requeued == 1
        clock.advance(3600)  # past the backoff
        await execute(queue, "worker-b")
        return JSONResponse({"paid": True})

    await execute(queue, "worker-a")
    assert hits == ["pay"]  # the unsafe call was never repeated
    done = await current(queue, run.id)
    assert done.status == "succeeded"
    assert done.result["tool_outcomes"][0]["status"] == "uncertain"
    types = [e.type for e in await queue.events(run.id)]
    assert "run.requeued" in types
    assert types[-1] == "run.fenced"
    return run.id


async def failed_run(queue: Queue, tenant: str = "acme") -> UUID:
    """A run the runtime fails at once (a permanent error): the dead letter."""
    run = await queue.enqueue(
        NewRun(
            tenant_id=tenant,
            principal="alice",
            agent="scripted",
            input={"script": [{"call": "teleport", "args": {"to": "mars"}}]},
        )
    )
    await execute(queue, "worker-a")
    assert (await current(queue, run.id)).status == "failed"
    return run.id


async def sign_in(page: Page, api: Api, key: str) -> None:
    await page.goto(f"{api.base}/ui")
    await expect(page).to_have_url(f"{api.base}/ui/sign-in?next=%2Fui")
    await page.get_by_label("API key").fill(key)
    await page.get_by_role("button", name="Sign in").click()


async def test_operator_sees_the_overview_and_a_recovered_runs_timeline(
    database_url: str,
    engine: AsyncEngine,
    clocked: tuple[Queue, ManualClock],
    payments: tuple[FastAPI, str],
) -> None:
    queue, clock = clocked
    run_id = await recovered_run(queue, clock, payments)
    await failed_run(queue)
    # Work the pool will not claim yet (scheduled), and a live pool with its slot groups.
    later = datetime(2100, 1, 1, tzinfo=UTC)
    for klass in (PriorityClass.INTERACTIVE, PriorityClass.ASYNC, PriorityClass.ASYNC):
        await queue.enqueue(
            NewRun(
                tenant_id="acme",
                principal="alice",
                agent="scripted",
                input={"text": "later"},
                priority=klass.base,
                scheduled_for=later,
            )
        )
    async with (
        running_api(
            database_url, engine, workers=True, slots="interactive:2,async:2,maintenance:1"
        ) as api,
        chromium() as browser,
    ):
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "ops", "operator"))
        await expect(page).to_have_url(f"{api.base}/ui")
        await expect(page.get_by_test_id("signed-in-as")).to_contain_text("acme/ops")
        interactive = page.locator('tr[data-class="interactive"]')
        await expect(interactive.locator('td[data-status="queued"]')).to_have_text("1")
        await expect(page.locator('tr[data-class="async"] td[data-status="queued"]')).to_have_text(
            "2"
        )
        await expect(page.locator('dd[data-stat="fenced"]')).to_have_text("1")
        await expect(page.locator('dd[data-stat="requeued"]')).to_have_text("1")
        await expect(page.locator('dd[data-stat="dead-letter"]')).to_have_text("1")
        await expect(page.locator('tr[data-group="interactive"] td').nth(2)).to_have_text("2")

        # The overview refreshes itself: a new run shows up with no reload of the page.
        await page.evaluate("window.notReloaded = true")
        await api.queue.enqueue(
            NewRun(
                tenant_id="acme",
                principal="alice",
                agent="scripted",
                input={"text": "later"},
                scheduled_for=later,
            )
        )
        await expect(interactive.locator('td[data-status="queued"]')).to_have_text(
            "2", timeout=15_000
        )
        assert await page.evaluate("window.notReloaded") is True
        await browser.screenshot(page, "ui-overview")

        # From the runs list to the recovered run's page.
        await page.get_by_role("link", name="Runs", exact=True).click()
        await page.get_by_label("Status").select_option("succeeded")
        await page.get_by_role("button", name="Filter").click()
        await expect(page.locator("tr[data-run]")).to_have_count(1)
        await browser.screenshot(page, "ui-runs")
        await page.get_by_role("link", name=str(run_id)).click()
        await expect(page.get_by_test_id("run-status")).to_have_text("succeeded")
        timeline = page.get_by_test_id("timeline")
        claims = timeline.locator('li[data-type="run.claimed"]')
        await expect(claims).to_have_count(2)
        await expect(claims.nth(0)).to_contain_text("claimed at epoch 1")
        await expect(claims.nth(1)).to_contain_text("claimed at epoch 2")
        await expect(timeline.locator('li[data-type="run.requeued"]')).to_contain_text(
            "lease_expired"
        )
        uncertain = timeline.locator("li.uncertain")
        await expect(uncertain).to_have_count(1)
        await expect(uncertain).to_contain_text("tool http_request uncertain, step 1, unsafe")
        fence = timeline.locator("li.fence")
        await expect(fence).to_have_count(1)
        await expect(fence).to_contain_text("fenced: a worker at stale epoch 1")
        await expect(fence).to_contain_text("worker worker-a, during tool_finished")
        # Highlighted, not just labelled.
        background = await uncertain.evaluate("el => getComputedStyle(el).backgroundColor")
        assert background not in ("rgba(0, 0, 0, 0)", "transparent")
        await browser.screenshot(page, "ui-run-timeline")
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console


async def test_operator_resubmits_and_dismisses_from_the_dead_letter(
    database_url: str, engine: AsyncEngine, clocked: tuple[Queue, ManualClock]
) -> None:
    queue, _ = clocked
    first = await failed_run(queue)
    second = await failed_run(queue)
    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "ops", "operator"))
        await page.get_by_role("link", name="Dead letter").click()
        rows = page.get_by_test_id("dead-letter").locator("tr[data-run]")
        await expect(rows).to_have_count(2)
        await expect(rows.first).to_contain_text("unknown_tool")
        await browser.screenshot(page, "ui-dead-letter")

        await page.locator(f'tr[data-run="{first}"]').get_by_role("button", name="Resubmit").click()
        notice = page.get_by_test_id("notice")
        await expect(notice).to_contain_text(f"Resubmitted run {first} as new run")
        async with engine.connect() as conn:
            row = (
                (
                    await conn.execute(
                        text("SELECT id, status FROM runs WHERE resubmitted_from = :id"),
                        {"id": first},
                    )
                )
                .mappings()
                .one()
            )
        assert row["status"] == "queued"
        assert str(row["id"]) in (await notice.text_content() or "")
        events = await api.queue.events(first)
        assert events[-1].type == "operator.resubmitted"
        assert "(acme/ops)" in events[-1].data["by"]

        await page.locator(f'tr[data-run="{second}"]').get_by_role("button", name="Dismiss").click()
        await expect(notice).to_contain_text(f"Dismissed run {second}")
        assert (await current(api.queue, second)).dismissed_at is not None
        await expect(rows).to_have_count(1)  # resubmitted runs stay failed until dismissed
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console


async def test_keys_without_the_operator_scope_cannot_act_and_tenants_stay_apart(
    database_url: str, engine: AsyncEngine, clocked: tuple[Queue, ManualClock]
) -> None:
    queue, _ = clocked
    ours = await failed_run(queue, "acme")
    theirs = await failed_run(queue, "globex")
    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "alice"))
        await expect(page).to_have_url(f"{api.base}/ui/runs")
        await expect(page.get_by_test_id("signed-in-as")).to_contain_text("read only")
        await expect(page.get_by_role("link", name="Dead letter")).to_have_count(0)
        await expect(page.locator("tr[data-run]")).to_have_count(1)  # not globex's
        await page.get_by_role("link", name=str(ours)).click()
        await expect(page.get_by_test_id("failure")).to_contain_text("unknown_tool")
        await expect(page.get_by_role("button", name="Resubmit")).to_have_count(0)
        # A hand-made POST, with this session's own cookie and CSRF token, is refused too.
        csrf = await page.locator('input[name="csrf"]').first.get_attribute("value")
        refused = await page.request.post(
            f"{api.base}/ui/runs/{ours}/resubmit",
            form={"csrf": csrf or ""},
            headers={"Origin": api.base},
        )
        assert refused.status == 403
        assert "operator scope" in await refused.text()
        async with engine.connect() as conn:
            resubmits = (
                await conn.execute(
                    text("SELECT count(*) FROM runs WHERE resubmitted_from IS NOT NULL")
                )
            ).scalar_one()
        assert resubmits == 0
        response = await page.goto(f"{api.base}/ui/dead-letter")
        assert response is not None
        assert response.status == 403
        response = await page.goto(f"{api.base}/ui/runs/{theirs}")
        assert response is not None
        assert response.status == 404
        await browser.screenshot(page, "ui-other-tenant-404")

        # An admin key of another tenant sees both tenants, and acts on neither.
        await browser.context.clear_cookies()
        await sign_in(page, api, await api.key("platform", "root", "admin"))
        await page.goto(f"{api.base}/ui/dead-letter")
        rows = page.get_by_test_id("dead-letter").locator("tr[data-run]")
        await expect(rows).to_have_count(2)
        await expect(page.get_by_role("button", name="Resubmit")).to_have_count(0)
        await expect(rows.first).to_contain_text("another tenant's")
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console


async def test_a_session_page_shows_its_conversation_and_its_runs(
    database_url: str, engine: AsyncEngine, clocked: tuple[Queue, ManualClock]
) -> None:
    queue, clock = clocked
    session = await Reads(queue).create_session(tenant_id="acme", principal="alice")
    submissions = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )
    alice = Submitter(tenant_id="acme", principal="alice")
    first = await submissions.submit_turn(
        alice,
        session.id,
        RunSpec(
            input={
                "script": [
                    {"call": "echo", "args": {"name": "Bob"}},
                    {"final": "Hello Bob, nice to meet you."},
                ]
            }
        ),
    )
    await execute(queue, "worker-a")
    # A later turn, later on the clock: the runs list is newest first by creation time, and
    # two runs created at the same instant would come in the order of their ids.
    clock.advance(1)
    second = await submissions.submit_turn(
        alice, session.id, RunSpec(input={"script": [{"call": "teleport"}]})
    )
    await execute(queue, "worker-a")
    assert (await current(queue, second.run_id)).status == "failed"

    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        await sign_in(page, api, await api.key("acme", "alice"))
        await page.goto(f"{api.base}/ui/runs/{first.run_id}")
        await page.get_by_test_id("session-link").click()
        await expect(page).to_have_url(f"{api.base}/ui/sessions/{session.id}")
        await expect(page.get_by_test_id("session-state")).to_have_text("idle")
        transcript = page.get_by_test_id("transcript").locator("li.message")
        await expect(transcript).to_have_count(5)
        await expect(transcript.nth(0)).to_have_attribute("data-role", "user")
        await expect(transcript.nth(1)).to_contain_text("tool echo (succeeded)")
        await expect(transcript.nth(1)).to_contain_text('{"name": "Bob"}')
        await expect(transcript.nth(2)).to_contain_text("Hello Bob, nice to meet you.")
        await expect(transcript.nth(3)).to_have_attribute("data-run-no", "2")
        ended = transcript.nth(4)
        await expect(ended).to_contain_text("run failed")
        await expect(ended).to_contain_text("unknown_tool")
        background = await ended.evaluate("el => getComputedStyle(el).backgroundColor")
        assert background not in ("rgba(0, 0, 0, 0)", "transparent")
        runs = page.get_by_test_id("session-runs").locator("tr[data-run]")
        await expect(runs).to_have_count(2)
        await expect(runs.nth(0)).to_contain_text("failed")  # newest first
        await browser.screenshot(page, "ui-session")
        await transcript.nth(0).get_by_role("link", name="run 1").click()
        await expect(page.get_by_test_id("run-status")).to_have_text("succeeded")

        # Another principal of the tenant, without a scope, does not see it.
        await browser.context.clear_cookies()
        await sign_in(page, api, await api.key("acme", "bob"))
        response = await page.goto(f"{api.base}/ui/sessions/{session.id}")
        assert response is not None
        assert response.status == 404
        assert browser.blocked == [], browser.blocked
        assert browser.script_errors == [], browser.console
