"""Rolling upgrades: the release before a migration and the release after it run together on
the migrated schema, and no run is stranded (issue 32, defect 3; docs/deployment.md).

`turnstile serve` migrates at start and fleets upgrade one process at a time, so every
migration must be safe for the release before it (ADR-0004's partners in BRIEF.md: expand,
then contract in a later release). For every migration added since this test exists, in a
database of its own:

1. the release before the migration (a git worktree of the last commit before it was added)
   migrates the database to its own head and starts a worker; it enqueues runs (immediate
   and a few seconds ahead) and a schedule firing every two seconds;
2. the release with the migration migrates the database while that worker runs and
   enqueues runs, which the older worker alone serves for a while; then it starts a worker;
3. the older worker is stopped and the older release's clients enqueue again: the newer
   worker alone must claim what they make;
4. every run created ends `succeeded`, the older release's schedule keeps firing, and the
   invariants of the runs and the counts hold.

A migration that stranded work across releases (as 0014 did: the older release's enqueues set
no mark the newer claims read, so nothing claimed them) fails here: its runs stay queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.engine import create_engine
from tests.support.invariants import check_all_runs
from tests.support.processes import Child, run_cli, turnstile
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]

MIGRATIONS = (
    "0015",
    "0016",
    "0018",
    "0020",
    "0021",
    "0022",
    "0023",
    "0024",
    "0025",
    "0026",
    "0027",
    "0028",
    "0029",
    "0030",
)
"""Every migration added since this test exists; a new migration joins the list."""

# Enqueues through a release's own queue API, whatever its module layout.
ENQUEUE = """
import asyncio, sys
from datetime import UTC, datetime, timedelta
try:
    from app.store.engine import create_engine
except ImportError:
    from app.db.engine import create_engine
try:
    from app.vocabulary.records import NewRun
except ImportError:
    from app.queue.models import NewRun
from app.config import Settings
from app.queue.core import Queue
try:
    from app.queue.scheduling import NewSchedule, Schedules
except ImportError:
    from app.queue.schedules import NewSchedule, Schedules

async def main(url, tenant, count, schedule):
    engine = create_engine(Settings(database_url=url), url, pool_size=2)
    queue = Queue(engine)
    script = {"script": [{"call": "sleep", "args": {"seconds": 0.05}}, {"final": "done"}]}
    for n in range(count):
        later = datetime.now(UTC) + timedelta(seconds=2) if n % 3 == 0 else None
        await queue.enqueue(NewRun(tenant_id=f"{tenant}-{n % 4}", principal="p",
                                   agent="scripted", input=script, priority=10,
                                   scheduled_for=later))
    await queue.enqueue_many(tenant_id=tenant, principal="p",
                             runs=[("scripted", script, 10, None)] * count)
    if schedule:
        await Schedules(queue).create(NewSchedule(
            tenant_id=f"{tenant}-cron", principal="p", cron="*/2 * * * * *",
            agent="scripted", input=script, priority=10))
    await engine.dispose()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "yes"))
"""


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def added(revision: str) -> str:
    """The commit that added migration `revision`."""
    found = git("log", "--diff-filter=A", "--format=%H", "--", f"alembic/versions/{revision}_*")
    if not found:
        pytest.fail(f"migration {revision} is not committed: commit it before this test runs")
    return found.splitlines()[-1]


@pytest.fixture(scope="module")
def releases() -> Iterator[dict[str, tuple[Path, Path]]]:
    """For each migration: (the release before it, the release with it), as checkouts."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the releases before each migration are not at hand")
    folder = Path(tempfile.mkdtemp(prefix="turnstile-releases-"))
    made: list[Path] = []

    def checkout(commit: str) -> Path:
        path = folder / commit[:12]
        if not path.exists():
            git("worktree", "add", "--detach", str(path), commit)
            made.append(path)
        return path

    found: dict[str, tuple[Path, Path]] = {}
    for index, revision in enumerate(MIGRATIONS):
        before = checkout(f"{added(revision)}^")
        following = MIGRATIONS[index + 1] if index + 1 < len(MIGRATIONS) else None
        with_it = checkout(f"{added(following)}^") if following else ROOT
        found[revision] = (before, with_it)
    try:
        yield found
    finally:
        for path in made:
            git("worktree", "remove", "--force", str(path))
        shutil.rmtree(folder, ignore_errors=True)


async def _enqueue(release: Path, url: str, tenant: str, *, schedule: bool = False) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        ENQUEUE,
        url,
        tenant,
        "12",
        "yes" if schedule else "no",
        cwd=release,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-3000:]


async def _migrate(release: Path, url: str) -> None:
    code, _, err = await run_cli("migrate", env={"DATABASE_URL": url}, cwd=str(release))
    assert code == 0, err


def _worker(release: Path, url: str) -> AbstractAsyncContextManager[Child]:
    return turnstile(
        "worker",
        ready=b"running slots",
        env={
            "DATABASE_URL": url,
            "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_SLOTS": "interactive:1,async:8,maintenance:1",
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "1",
        },
        cwd=str(release),
    )


@pytest.mark.parametrize("revision", MIGRATIONS)
async def test_the_release_before_a_migration_runs_beside_the_one_after(
    revision: str,
    releases: dict[str, tuple[Path, Path]],
    empty_database: str,
) -> None:
    before, with_it = releases[revision]
    url = empty_database
    await _migrate(before, url)
    async with contextlib.AsyncExitStack() as stack:
        # The older fleet: a worker, and a client enqueueing (an API process of its release).
        old_worker = await stack.enter_async_context(_worker(before, url))
        await _enqueue(before, url, "before", schedule=True)
        # The first process of the newer release migrates, and enqueues while only the
        # older worker runs.
        await _migrate(with_it, url)
        await _enqueue(with_it, url, "after")
        # A newer worker joins; the older one is stopped (it drains); the older release's
        # clients go on enqueueing, and only the newer worker is left to claim.
        await stack.enter_async_context(_worker(with_it, url))
        old_worker.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(old_worker.process.wait(), 60) == 0
        await _enqueue(before, url, "before-again")
        engine = create_engine(Settings(database_url=None), url, pool_size=2)
        stack.push_async_callback(engine.dispose)
        await eventually(lambda: _finished(engine), within=90, what="every run done")
        async with engine.connect() as conn:
            statuses = dict(
                (
                    await conn.execute(
                        text(
                            "SELECT status, count(*) FROM runs WHERE schedule_id IS NULL GROUP BY 1"
                        )
                    )
                ).all()
            )
        # 12 single runs and 12 in bulk from each of the three enqueues.
        assert statuses == {"succeeded": 72}, statuses
        # The counts' invariants are this release's: checked on its own schema only.
        await check_all_runs(engine, counts=with_it == ROOT)


async def _finished(engine: AsyncEngine) -> bool:
    """Every run but the schedule's ticks ahead has finished, and two ticks have run."""
    async with engine.connect() as conn:
        left = await conn.scalar(
            text(
                "SELECT count(*) FROM runs WHERE schedule_id IS NULL"
                " AND status NOT IN ('succeeded', 'failed', 'cancelled')"
            )
        )
        ticks = await conn.scalar(
            text("SELECT count(*) FROM runs WHERE schedule_id IS NOT NULL AND status = 'succeeded'")
        )
    return left == 0 and (ticks or 0) >= 2
