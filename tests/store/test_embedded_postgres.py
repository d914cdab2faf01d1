"""Smoke test of the zero-setup default: the embedded PostgreSQL starts in a data folder,
migrates, answers a query, stops, and keeps its data across a restart. CI uses the machine's
server for everything else, so this test is what keeps the default from rotting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import asyncpg
import httpx
import pytest

from app.store.embedded import (
    LocalCluster,
    free_port,
    pgserver_bin_dir,
    start_embedded,
    system_bin_dir,
)
from app.store.engine import plain_url
from app.store.migrate import head_revision, upgrade
from tests.support.waiting import eventually


async def test_embedded_start_migrate_query_stop_restart() -> None:
    folder = Path(tempfile.mkdtemp(prefix="turnstile-embedded-"))
    try:
        embedded = await asyncio.to_thread(start_embedded, folder)
        assert "host=" in embedded.url  # a Unix socket, no TCP port
        await asyncio.to_thread(upgrade, embedded.url)
        conn = await asyncpg.connect(plain_url(embedded.url))
        try:
            assert await conn.fetchval("SELECT version_num FROM alembic_version") == (
                head_revision()
            )
            await conn.execute("INSERT INTO sessions (tenant_id, principal) VALUES ('t', 'p')")
        finally:
            await conn.close()
        await asyncio.to_thread(embedded.stop)

        again = await asyncio.to_thread(start_embedded, folder)
        conn = await asyncpg.connect(plain_url(again.url))
        try:
            assert await conn.fetchval("SELECT count(*) FROM sessions") == 1
        finally:
            await conn.close()
        await asyncio.to_thread(again.stop)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_cluster_starts_from_binaries_under_a_private_folder(tmp_path: Path) -> None:
    """A checkout under a folder only root may enter (mktemp -d makes it 0700) must not keep
    the server's own user from running initdb and postgres out of it."""
    installed = pgserver_bin_dir()
    if installed is None:
        pytest.skip("pgserver's binaries are not installed (no wheel for this Python)")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    # The package and the shared libraries its binaries find through their rpath, as pip laid
    # them out in site-packages.
    site = installed.parents[2]
    for folder in ("pgserver", "pgserver.libs"):
        shutil.copytree(site / folder, private / folder, symlinks=True)
    cluster = LocalCluster(
        bin_dir=private / installed.relative_to(site),
        data_dir=tmp_path / "data",
        port=free_port(),
    )
    try:
        cluster.init()
        cluster.start()
        assert cluster.running()
    finally:
        cluster.stop("immediate")


def error_lines(log: str) -> list[str]:
    """The lines of a process's stderr that report an error: a JSON log line at level error or
    critical, a traceback, or a plain line that says error."""
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            if str(record.get("level", "")).lower() in ("error", "critical"):
                found.append(line)
        elif "error" in line.lower() or "traceback" in line.lower():
            found.append(line)
    return found


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
async def test_a_service_on_the_embedded_server_stops_cleanly_on_a_group_signal(
    stop_signal: signal.Signals, tmp_path: Path
) -> None:
    """`make run` stopped from the terminal (SIGINT to the foreground process group) or by a
    supervisor (SIGTERM to the group), with a run executing and a long poll open: the pool
    drains and releases the run, the long poll answers, the engine is disposed, and only then
    is the embedded server stopped; the process exits 0 with no error line. The embedded server
    runs in a session of its own, so the group's signal never reaches it directly."""
    data_dir = tmp_path / "data"
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={
            **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
            "TURNSTILE_DATA_DIR": str(data_dir),
            "TURNSTILE_PORT": str(port),
            "TURNSTILE_DRAIN_GRACE_SECONDS": "1",
        },
        start_new_session=True,  # its own process group, as a shell gives `make run`
    )
    log = bytearray()
    stderr = process.stderr
    assert stderr is not None

    async def read_log() -> None:
        while chunk := await stderr.read(65536):
            log.extend(chunk)

    reading = asyncio.create_task(read_log())
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:

            async def ready() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    return (await client.get("/readyz")).status_code == 200
                assert process.returncode is None, log.decode(errors="replace")
                return False

            await eventually(ready, within=120, what="the service on the embedded server")
            key = (data_dir / "dev-key").read_text().strip()
            client.headers["Authorization"] = f"Bearer {key}"
            slow = (
                await client.post(
                    "/runs",
                    json={"input": {"script": [{"call": "sleep", "args": {"seconds": 60}}]}},
                )
            ).json()
            later = (
                await client.post(
                    "/runs", json={"input": 1, "scheduled_for": "2099-01-01T00:00:00Z"}
                )
            ).json()

            async def executing() -> bool:
                events = (await client.get(f"/runs/{slow['id']}/events")).json()["events"]
                return any(event["type"] == "tool.started" for event in events)

            await eventually(executing, within=30, what="the run's tool call")
            sent = asyncio.Event()

            async def mark_sent(request: httpx.Request) -> None:
                sent.set()

            async with httpx.AsyncClient(
                base_url=base,
                timeout=60,
                headers=client.headers,
                event_hooks={"request": [mark_sent]},
            ) as polling:
                poll = asyncio.create_task(
                    polling.get(f"/runs/{later['id']}", params={"wait": 55, "status": "queued"})
                )
                await asyncio.wait_for(sent.wait(), 10)

                async def polling_now() -> bool:
                    # The poll holds its place only inside its handler: then a shutdown answers
                    # it. (A round trip after sending it proved nothing: a request not yet read
                    # is closed unanswered at shutdown, and this test failed that way.)
                    found = (await client.get("/metrics")).text
                    return "\nturnstile_api_open_streams 1.0\n" in found

                await eventually(polling_now, within=10, what="the long poll in its handler")
                signalled = asyncio.get_running_loop().time()
                os.killpg(process.pid, stop_signal)
                status = await asyncio.wait_for(process.wait(), 60)
                assert status == 0, log.decode(errors="replace")
                # Answered by the shutdown (well before its 55 s), as it stood: still queued.
                answered = await asyncio.wait_for(poll, 30)
                assert answered.status_code == 200
                assert answered.json()["status"] == "queued"
                assert asyncio.get_running_loop().time() - signalled < 50
        await reading
        text = log.decode(errors="replace")
        assert error_lines(text) == [], text
        # The order: the pool drained and the lifespan finished before the server was let go.
        drained = text.index("worker pool stopped")
        finished = text.index("Application shutdown complete")
        if pgserver_bin_dir() is not None:
            released = text.index("embedded PostgreSQL released")
            assert drained < finished < released, text
            pgdata = LocalCluster(
                bin_dir=pgserver_bin_dir() or Path(), data_dir=data_dir / "pgdata"
            )
            assert not pgdata.running()  # this process was its only user: stopped
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        reading.cancel()
        # Whatever happened, leave no server running on the test's folder.
        for folder in ("pgdata", "pgdata-system"):
            bin_dir = pgserver_bin_dir() or system_bin_dir()
            if bin_dir is not None and (data_dir / folder).exists():
                LocalCluster(bin_dir=bin_dir, data_dir=data_dir / folder).stop("immediate")


async def test_a_worker_on_the_embedded_server_releases_it_after_draining(
    tmp_path: Path,
) -> None:
    """`turnstile worker` with no DATABASE_URL: the embedded server it started is let go only
    after its pool drained, and stops, since nothing else holds it."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
        "TURNSTILE_DATA_DIR": str(tmp_path / "data"),
    }
    try:
        migrate = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "migrate", env=env, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(migrate.communicate(), 120)
        assert migrate.returncode == 0, err.decode()
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            "worker",
            env=env,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        stderr = worker.stderr
        assert stderr is not None
        log = bytearray()
        while b"running slots" not in (line := await asyncio.wait_for(stderr.readline(), 60)):
            assert line, log.decode(errors="replace")
            log.extend(line)
        os.killpg(worker.pid, signal.SIGTERM)
        log.extend(await asyncio.wait_for(stderr.read(), 60))
        assert await worker.wait() == 0, log.decode(errors="replace")
        text = log.decode(errors="replace")
        assert error_lines(text) == [], text
        if pgserver_bin_dir() is not None:
            assert text.index("worker pool stopped") < text.index("embedded PostgreSQL released"), (
                text
            )
            pgdata = LocalCluster(
                bin_dir=pgserver_bin_dir() or Path(), data_dir=tmp_path / "data/pgdata"
            )
            assert not pgdata.running()
    finally:
        bin_dir = pgserver_bin_dir() or system_bin_dir()
        for folder in ("pgdata", "pgdata-system"):
            if bin_dir is not None and (tmp_path / "data" / folder).exists():
                LocalCluster(bin_dir=bin_dir, data_dir=tmp_path / "data" / folder).stop("immediate")
