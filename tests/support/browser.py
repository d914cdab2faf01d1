"""A real browser for tests: Debian's headless Chromium, driven by Playwright for Python.

Playwright's own browser download cannot work here (and is never needed): the tests launch
the system's `chromium` binary through `executable_path`. A missing binary skips the test, or
fails it under `TURNSTILE_REQUIRE_SYSTEM_TESTS=1` (tests/support/system_tools.py).

Every page runs offline: requests to anything but 127.0.0.1 are aborted and recorded in
`Browser.blocked`, so a test can assert that nothing tried to leave the machine. Screenshots
go to `test-artifacts/` (git-ignored); the path is printed so a CI log shows where they are.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from playwright.async_api import BrowserContext, Page, Route, async_playwright

from tests.support.system_tools import require_tool

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}


@dataclass
class Browser:
    context: BrowserContext
    blocked: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)  # the pages' console messages and errors

    @property
    def script_errors(self) -> list[str]:
        """Uncaught script errors and refusals by the Content-Security-Policy (error pages'
        own 4xx statuses are expected and left out)."""
        return [
            m for m in self.console if m.startswith("pageerror:") or "Content Security Policy" in m
        ]

    async def page(self) -> Page:
        page = await self.context.new_page()
        page.set_default_timeout(15_000)
        page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))
        return page

    async def screenshot(self, page: Page, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{re.sub(r'[^a-z0-9_-]+', '-', name.lower())}.png"
        await page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


@asynccontextmanager
async def chromium(viewport: tuple[int, int] = (1400, 900)) -> AsyncIterator[Browser]:
    """Launch Debian's Chromium headless with a fresh context that only reaches loopback."""
    binary = require_tool("chromium", "/usr/bin/chromium")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(binary), args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = await browser.new_context(
                viewport={"width": viewport[0], "height": viewport[1]}
            )
            state = Browser(context)

            async def only_loopback(route: Route) -> None:
                url = route.request.url
                host = urlsplit(url).hostname or ""
                if url.startswith(("data:", "blob:")) or host in LOOPBACK or host == "::1":
                    await route.continue_()
                else:
                    state.blocked.append(url)
                    await route.abort("internetdisconnected")

            await context.route("**/*", only_loopback)
            yield state
            await context.close()
        finally:
            await browser.close()
