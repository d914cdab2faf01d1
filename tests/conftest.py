"""Shared fixtures: a real PostgreSQL (never SQLite, never a mock), migrated once per session.

- `server_url`: the PostgreSQL server (TEST_DATABASE_URL, else an embedded one).
- `template_database`: a database migrated to head, used as the template for clones.
- `database_url`: a fresh clone per test, for tests that need several connections, real
  commits, SKIP LOCKED, LISTEN/NOTIFY or lease expiry.
- `engine`: an engine on that clone, disposed after the test.
- `db_conn`: one connection in a transaction rolled back after the test, on a shared clone,
  for tests that need a single connection.
- `throwaway_cluster`: a PostgreSQL cluster of the test's own, started from the embedded
  package's binaries, that the test may stop, restart or kill.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.config import Settings
from app.queue.core import Queue, QueueConfig
from app.store.embedded import (
    LocalCluster,
    free_port,
    pgserver_bin_dir,
    start_embedded,
    system_bin_dir,
)
from app.store.engine import create_claim_engine, create_engine
from app.store.migrate import upgrade
from tests.support.clock import ManualClock
from tests.support.databases import (
    admin_execute,
    clone_database,
    drop_database,
    new_database_name,
    with_database,
)


@pytest.fixture(scope="session")
def server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL")
    if not url:
        # No server given: the same embedded PostgreSQL users get, in a folder of the suite's
        # (one per test process when the suite runs in several: each starts and stops its own).
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        folder = Path(tempfile.gettempdir()) / f"turnstile-test-embedded{worker and '-' + worker}"
        url = start_embedded(folder).url
    os.environ["TURNSTILE_TEST_SERVER_URL"] = url
    return url


@pytest.fixture(scope="session")
def template_database(server_url: str) -> Iterator[str]:
    name = new_database_name("ts_template")
    asyncio.run(admin_execute(server_url, f'CREATE DATABASE "{name}"'))
    # Alembic runs its own event loop and disposes its engine before we clone from it.
    upgrade(with_database(server_url, name))
    yield name
    asyncio.run(admin_execute(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def empty_database(server_url: str) -> AsyncIterator[str]:
    """A database with no schema at all, for migrations and for code that must refuse it."""
    name = new_database_name("ts_empty")
    await admin_execute(server_url, f'CREATE DATABASE "{name}"')
    url = with_database(server_url, name)
    yield url
    await drop_database(server_url, url)


@pytest.fixture
def settings() -> Settings:
    # Short leases so tests that wait for expiry stay quick; tests needing others make their own.
    return Settings(database_url=None, lease_seconds=3.0, heartbeat_seconds=0.5)


@pytest.fixture
async def database_url(server_url: str, template_database: str) -> AsyncIterator[str]:
    url = await clone_database(server_url, template_database)
    yield url
    await drop_database(server_url, url)


@pytest.fixture
async def engine(settings: Settings, database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(settings, database_url, pool_size=10)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def shared_database(server_url: str, template_database: str) -> Iterator[str]:
    url = asyncio.run(clone_database(server_url, template_database))
    yield url
    asyncio.run(drop_database(server_url, url))


@pytest.fixture
async def db_conn(settings: Settings, shared_database: str) -> AsyncIterator[AsyncConnection]:
    engine = create_engine(settings, shared_database, pool_size=1)
    try:
        async with engine.connect() as conn:
            transaction = await conn.begin()
            try:
                yield conn
            finally:
                await transaction.rollback()
    finally:
        await engine.dispose()


@pytest.fixture
def throwaway_cluster() -> Iterator[LocalCluster]:
    bin_dir = pgserver_bin_dir() or system_bin_dir()
    if bin_dir is None:
        pytest.fail("no PostgreSQL binaries: install the test extras (pgserver)")
    folder = Path(tempfile.mkdtemp(prefix="turnstile-cluster-"))
    cluster = LocalCluster(bin_dir=bin_dir, data_dir=folder / "data", port=free_port())
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def queue(
    engine: AsyncEngine, clock: ManualClock, settings: Settings, database_url: str
) -> AsyncIterator[Queue]:
    config = QueueConfig(
        lease_seconds=30, max_attempts=3, backoff_base_seconds=5, backoff_max_seconds=300
    )
    # Claims on connections of their own with generic plans, as the service claims.
    claim_engine = create_claim_engine(settings, database_url)
    yield Queue(engine, config, clock=clock, claim_engine=claim_engine)
    if claim_engine is not None:
        await claim_engine.dispose()


WORKER_REPORTS: list[str] = []
"""The chaos suite's reports sent by the suite's other processes (pytest-xdist's workers)."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a worker process of a parallel run, hand this process's reports to the controller."""
    from tests.support.chaos import REPORTS

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["reliability_reports"] = list(REPORTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller of a parallel run collects each worker's reports as it finishes."""
    WORKER_REPORTS.extend(getattr(node, "workeroutput", {}).get("reliability_reports", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the chaos suite's reports, so a CI log shows what was proven."""
    from tests.support.chaos import REPORTS

    for text in [*REPORTS, *WORKER_REPORTS]:
        terminalreporter.write_sep("-", "reliability report")
        terminalreporter.write_line(text)
