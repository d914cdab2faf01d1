"""The TypeScript client (clients/typescript, `@turnstile/client`), built and tested by `make
test`: `npm ci` from its package-lock.json, the build (tsc, and esbuild's one-file bundle for
pages without a bundler), its API types checked against the server's OpenAPI document, Node's own
test runner against a real `turnstile serve`, the clients guide's example run in Node, and Debian's
Chromium (through Playwright) on a page of another loopback origin that imports the built bundle
and calls the API through CORS; a page of an origin not allowed is refused by the browser.

Without node and npm (or chromium) these skip with a one-line reason; under
TURNSTILE_REQUIRE_SYSTEM_TESTS=1 (CI) they fail instead.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import FileResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import create_key
from app.store.embedded import free_port
from tests.support.browser import chromium
from tests.support.processes import turnstile
from tests.support.servers import running_server
from tests.support.system_tools import require_tool

pytestmark = [pytest.mark.system, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"
CLIENTS_GUIDE = ROOT / "docs" / "guides" / "clients.md"


def npm(*args: str, timeout: float = 600) -> str:
    """`npm ARGS` in the package folder; its output, or a failure showing the end of it."""
    done = subprocess.run(
        [str(require_tool("npm")), *args],
        cwd=PACKAGE,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"npm {' '.join(args)}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


@pytest.fixture(scope="session")
def built() -> Path:
    """The package installed from its lock file and built; its folder."""
    require_tool("node", "nodejs")
    require_tool("npm")
    installed = PACKAGE / "node_modules" / ".package-lock.json"
    lock = PACKAGE / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        npm("ci", "--no-audit", "--no-fund", "--loglevel=error")
    npm("run", "build")
    assert (PACKAGE / "dist" / "turnstile-client.js").is_file()
    return PACKAGE


@dataclass
class Served:
    base: str
    key: str  # tenant acme, principal alice, no scope
    throttled_key: str  # a tenant allowed one submission (then 429 rate-limited)


@asynccontextmanager
async def serving(database_url: str, engine: AsyncEngine, **env: str) -> AsyncIterator[Served]:
    """`turnstile serve` as a real process on a free loopback port, with its keys."""
    port = free_port()
    settings = {
        "DATABASE_URL": database_url,
        # Every tenant rate limited, generously: answers carry RateLimit headers.
        "TURNSTILE_SUBMIT_RATE_PER_SECOND": "1000",
        "TURNSTILE_SUBMIT_BURST": "1000",
        **env,
    }
    async with turnstile("serve", "--port", str(port), ready=b"Uvicorn running", env=settings):
        base = f"http://127.0.0.1:{port}"
        admin = await create_key(engine, tenant_id="ops", principal="root", scopes=("admin",))
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            limited = await client.put(
                "/tenants/throttled/limits",
                json={"submit_rate_per_second": 0.001, "submit_burst": 1},
                headers={"Authorization": f"Bearer {admin.secret}"},
            )
            assert limited.status_code == 200, limited.text
        yield Served(
            base=base,
            key=(await create_key(engine, tenant_id="acme", principal="alice")).secret,
            throttled_key=(await create_key(engine, tenant_id="throttled", principal="bob")).secret,
        )


async def node(*args: str, cwd: Path, env: dict[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        str(require_tool("node", "nodejs")),
        *args,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **env},
    )
    out, _ = await asyncio.wait_for(process.communicate(), 300)
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"node {' '.join(args)}:\n{text[-6000:]}"
    return text


def tap_counts(output: str) -> dict[str, int]:
    """The summary of a `--test-reporter=tap` run: tests, pass, fail, skipped, ..."""
    return {name: int(n) for name, n in re.findall(r"^# (\w+) (\d+)$", output, re.MULTILINE)}


def test_the_api_types_are_the_servers_openapi_document(built: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(built / "scripts" / "generate_types.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_client_and_its_tests_type_check(built: Path) -> None:
    npm("run", "check")


async def test_nodes_test_runner_against_turnstile_serve(
    built: Path, database_url: str, engine: AsyncEngine
) -> None:
    async with serving(database_url, engine) as served:
        output = await node(
            "--test",
            "--test-reporter=tap",
            "test/live-text.test.js",
            "test/client.test.js",
            cwd=built,
            env={
                "TURNSTILE_URL": served.base,
                "TURNSTILE_KEY": served.key,
                "TURNSTILE_THROTTLED_KEY": served.throttled_key,
            },
        )
    counts = tap_counts(output)
    print(f"node --test: {counts}")
    assert counts["fail"] == 0, output[-6000:]
    assert counts["skipped"] == 0, output[-6000:]  # none skipped for want of a server
    assert counts["cancelled"] == 0, output[-6000:]
    assert counts["pass"] == counts["tests"] >= 16


def readme_example(heading: str, fence: str) -> str:
    section = CLIENTS_GUIDE.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1]
    return section.split(f"```{fence}\n", 1)[1].split("```", 1)[0]


async def test_the_readme_example_runs_in_node(
    built: Path, database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    example = readme_example("## Which client, where", "ts")
    assert 'from "@turnstile/client"' in example
    assert "http://127.0.0.1:8000" in example
    # A project of the user's: the package linked in as npm would install it.
    (tmp_path / "node_modules" / "@turnstile").mkdir(parents=True)
    (tmp_path / "node_modules" / "@turnstile" / "client").symlink_to(built)
    async with serving(database_url, engine) as served:
        (tmp_path / "example.mjs").write_text(example.replace("http://127.0.0.1:8000", served.base))
        output = await node("example.mjs", cwd=tmp_path, env={"TURNSTILE_KEY": served.key})
    assert output.splitlines()[-2:] == ["hello", "succeeded"]


def file_route(file: Path) -> Callable[[], Awaitable[FileResponse]]:
    async def send() -> FileResponse:
        return FileResponse(file)

    return send


@pytest.fixture
def page_files(built: Path) -> FastAPI:
    """The browser test's page: its HTML and script, and the built bundle, nothing else."""
    files = {
        "/": built / "test" / "browser" / "index.html",
        "/page.js": built / "test" / "browser" / "page.js",
        "/turnstile-client.js": built / "dist" / "turnstile-client.js",
    }
    app = FastAPI()
    for path, file in files.items():
        app.add_api_route(path, file_route(file), methods=["GET"])
    return app


async def test_a_browser_page_on_another_origin_uses_the_bundle_through_cors(
    page_files: FastAPI, database_url: str, engine: AsyncEngine
) -> None:
    async with (
        running_server(page_files) as page_origin,
        running_server(page_files) as stranger_origin,
    ):
        async with (
            serving(database_url, engine, TURNSTILE_CORS_ORIGINS=page_origin) as served,
            chromium() as browser,
        ):
            page = await browser.page()
            await page.goto(f"{page_origin}/")
            await page.wait_for_function(
                "document.getElementById('status').textContent === 'ready'"
            )
            seen = await page.evaluate(
                "([base, key, throttled]) => window.chat(base, key, throttled)",
                [served.base, served.key, served.throttled_key],
            )
            await browser.screenshot(page, "typescript-client-browser")

            other = await browser.page()
            await other.goto(f"{stranger_origin}/")
            await other.wait_for_function(
                "document.getElementById('status').textContent === 'ready'"
            )
            refused = await other.evaluate(
                "([base, key]) => window.refused(base, key)", [served.base, served.key]
            )
        assert browser.blocked == []
        assert browser.script_errors == []

    assert seen["completed"] == seen["text"]
    assert seen["deltas"] > 0
    assert seen["sameRun"] is True
    assert seen["location"].startswith("/runs/")
    assert seen["replayedHeader"] == "true"
    assert re.fullmatch(r'"submit";q=1000;w=1', seen["rateLimitPolicy"])
    assert seen["rateLimit"].startswith('"submit";r=')
    assert seen["busy"] == {"status": 409, "active": seen["heldId"]}
    assert seen["resumed"][0] == 3  # Last-Event-ID: 2 went through the preflight
    assert seen["retryAfter"] > 0  # Retry-After read from a 429
    assert refused.startswith("UnreachableError: cannot reach the Turnstile API at ")
    cors = [m for m in browser.console if "CORS policy" in m]
    assert cors, browser.console  # Chromium says why it kept the answer from the page
