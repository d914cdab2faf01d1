"""The first hour's logs and stops (issue 38 item 4), in real `turnstile` processes: JSON lines
when nobody reads them on a terminal and readable lines when TURNSTILE_LOG_FORMAT=text, never an
ANSI colour code inside JSON; a stop says "draining: N runs, up to S s", and a second Ctrl-C
ends the drain at once, its runs released (queued again), not finished."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import create_key
from app.store.embedded import LocalCluster, free_port, pgserver_bin_dir
from tests.support.processes import Child, turnstile
from tests.support.waiting import eventually


async def test_logs_are_json_off_a_terminal_with_no_colour_codes(database_url: str) -> None:
    port = free_port()
    env = {"DATABASE_URL": database_url}
    async with turnstile(
        "serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env
    ) as child:
        pass
    logged = [line for line in child.log.decode().splitlines() if line.startswith("{")]
    assert any("Uvicorn running" in json.loads(line)["message"] for line in logged)
    for line in logged:
        assert "color_message" not in json.loads(line), line
        assert "\x1b[" not in line, line
        assert "\\u001b[" not in line, line


async def test_log_format_text_gives_readable_lines(database_url: str) -> None:
    port = free_port()
    env = {"DATABASE_URL": database_url, "TURNSTILE_LOG_FORMAT": "text"}
    async with turnstile(
        "serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env
    ) as child:
        pass
    running = [line for line in child.log.decode().splitlines() if "Uvicorn running" in line]
    assert running
    assert not running[0].startswith("{"), running[0]
    assert running[0].startswith("info"), running[0]


async def _sleeping_run(client: httpx.AsyncClient) -> str:
    body = {"input": {"script": [{"call": "sleep", "args": {"seconds": 60}}, {"final": "done"}]}}
    response = await client.post("/runs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


async def _status(engine: AsyncEngine, run: str) -> str:
    async with engine.connect() as conn:
        found = await conn.scalar(text("SELECT status FROM runs WHERE id = :id"), {"id": run})
    return str(found)


async def _stop_twice(child: Child, engine: AsyncEngine, run: str) -> None:
    async def started() -> bool:
        async with engine.connect() as conn:
            return bool(
                await conn.scalar(
                    text(
                        "SELECT count(*) FROM run_events WHERE run_id = :id "
                        "AND type = 'tool.started'"
                    ),
                    {"id": run},
                )
            )

    await eventually(started, within=60, what="the run's sleep to start")
    child.process.send_signal(signal.SIGINT)
    await eventually(
        lambda: _said(child, b"draining: 1 runs, up to 300 s"), within=30, what="the line"
    )
    child.process.send_signal(signal.SIGINT)
    assert await child.process.wait() == 0
    # Released by the drain, not finished within its grace: queued again for another worker.
    assert await _status(engine, run) == "queued"


async def _said(child: Child, line: bytes) -> bool:
    return line in child.log


async def test_serve_says_it_drains_and_a_second_ctrl_c_releases_at_once(
    database_url: str, engine: AsyncEngine
) -> None:
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    port = free_port()
    env = {"DATABASE_URL": database_url, "TURNSTILE_DRAIN_GRACE_SECONDS": "300"}
    async with turnstile("serve", "--port", str(port), ready=b"Uvicorn running", env=env) as child:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
        ) as client:
            run = await _sleeping_run(client)
        await _stop_twice(child, engine, run)


async def test_worker_says_it_drains_and_a_second_ctrl_c_releases_at_once(
    database_url: str, engine: AsyncEngine
) -> None:
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    port = free_port()
    env: dict[str, Any] = {"DATABASE_URL": database_url, "TURNSTILE_DRAIN_GRACE_SECONDS": "300"}
    async with (
        turnstile("serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env),
        turnstile("worker", ready=b"running slots", env=env) as worker,
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
        ) as client,
    ):
        run = await _sleeping_run(client)
        await _stop_twice(worker, engine, run)


async def test_the_embedded_servers_narration_goes_to_its_own_file(tmp_path: Path) -> None:
    # No DATABASE_URL: the embedded PostgreSQL, initialised here (initdb's whole output).
    if pgserver_bin_dir() is None:
        pytest.skip("pgserver's binaries are not installed (no wheel for this Python)")
    data_dir = tmp_path / "data"
    env = {"DATABASE_URL": "", "TURNSTILE_DATA_DIR": str(data_dir)}
    try:
        async with turnstile(
            "serve", "--port", str(free_port()), ready=b"Uvicorn running", env=env
        ) as child:
            pass
        lines = child.log.decode().splitlines()
        ours = [json.loads(line) for line in lines if line.startswith("{")]
        assert ours
        assert [line for line in ours if line["logger"] == "pgserver"] == []
        assert not [line for line in lines if "initdb" in line or "Running commandline" in line]
        assert "initdb" in (data_dir / "embedded-postgres.log").read_text()
        assert any(line["message"] == "embedded PostgreSQL released" for line in ours)
    finally:
        if (data_dir / "pgdata").exists():
            LocalCluster(bin_dir=pgserver_bin_dir() or Path(), data_dir=data_dir / "pgdata").stop(
                "immediate"
            )
