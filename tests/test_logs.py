"""Structured logs from a real worker process: JSON lines, and every line about a run carries
its run id, session id, epoch, worker id and slot group; no secret reaches the log."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.vocabulary.records import NewRun
from tests.support.processes import turnstile
from tests.support.waiting import eventually

SECRET = "sk-this-must-never-be-logged"


async def test_a_worker_logs_json_lines_with_the_run_context(
    database_url: str, engine: AsyncEngine
) -> None:
    queue = Queue(engine)
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_LOG_LEVEL": "debug",
        "TURNSTILE_OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "TURNSTILE_OPENAI_API_KEY": SECRET,
    }
    async with turnstile("worker", ready=b"running slots", env=env) as worker:
        run = await queue.enqueue(
            NewRun(
                tenant_id="t",
                principal="p",
                agent="scripted",
                input={"script": [{"call": "teleport"}]},
            )
        )

        async def failed() -> bool:
            found = await queue.get_run(run.id)
            return found is not None and found.status == "failed"

        await eventually(failed, within=20, what="the run to fail")
    output = worker.log.decode()  # complete: the worker drained and exited 0
    assert SECRET not in output
    lines: list[dict[str, Any]] = [
        json.loads(line) for line in output.splitlines() if line.startswith("{")
    ]
    about_run = [line for line in lines if line.get("run_id") == str(run.id)]
    messages = {line["message"] for line in about_run}
    assert {"executing run", "run failed"} <= messages, lines
    for line in about_run:
        assert line["epoch"] == 1
        assert line["slot_group"] == "interactive"
        assert line["worker_id"]
        assert "session_id" in line
        assert line["level"] in ("debug", "info", "warning", "error")
    assert any(line.get("kind") == "unknown_tool" for line in about_run)
