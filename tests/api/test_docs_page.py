"""The OpenAPI docs page in a real browser (Debian's Chromium), with the network unplugged:
Swagger UI loads its script and styles from the service itself, never from a CDN. `/redoc` is
not served, since ReDoc fetches its logo from a CDN."""

from __future__ import annotations

import httpx
import pytest
from playwright.async_api import expect
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.browser import chromium

pytestmark = pytest.mark.system


async def api_status(base: str, path: str) -> int:
    async with httpx.AsyncClient(base_url=base) as client:
        return (await client.get(path)).status_code


async def test_swagger_ui_renders_the_operations_offline(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api, chromium() as browser:
        page = await browser.page()
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        await page.goto(f"{api.base}/docs")
        # Operations rendered by Swagger UI's own script, from the OpenAPI document.
        await expect(
            page.locator(".opblock-summary-path", has_text="/sessions/{session_id}/turns")
        ).to_be_visible()
        await expect(page.locator(".opblock-tag", has_text="runbook")).to_be_visible()
        assert await page.locator(".opblock").count() >= 15
        await browser.screenshot(page, "docs-swagger-ui")
        # Try it out: the page calls the API on the same server.
        await page.locator(".opblock-summary-path", has_text="/healthz").click()
        await page.get_by_role("button", name="Try it out").click()
        await page.get_by_role("button", name="Execute").click()
        await expect(
            page.locator(".live-responses-table tbody .response-col_status").first
        ).to_have_text("200")
        assert (await api_status(api.base, "/redoc")) == 404
        assert browser.blocked == [], f"requests that tried to leave loopback: {browser.blocked}"
        assert requested
        assert all(url.startswith((api.base, "data:")) for url in requested), requested
