"""Structured logs from a real worker process: JSON lines, and every line about a run carries
its run id, session id, epoch, worker id and slot group; no secret reaches the log."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.vocabulary.records import NewRun
from tests.support.processes import turnstile
from tests.support.servers import running_server
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


TOKEN = "tok-in-a-query-string-never-logged"
PASSWORD = "pw-in-a-url-never-logged"


async def test_outbound_urls_are_logged_without_their_query_or_user_info(
    database_url: str, engine: AsyncEngine
) -> None:
    """Issue 40, item 11: httpx logs every outbound request at info level with its full URL,
    and a query string may carry a token. The line stays, redacted."""
    hits: list[str] = []
    app = FastAPI()

    @app.get("/hook")
    async def hook(token: str) -> dict[str, bool]:
        hits.append(token)
        return {"ok": True}

    async with running_server(app) as base:
        port = base.rsplit(":", 1)[1]
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_LOG_LEVEL": "debug",
            "TURNSTILE_HTTP_ALLOWED_HOSTS": f"127.0.0.1:{port}",
        }
        queue = Queue(engine)
        url = f"http://probe:{PASSWORD}@127.0.0.1:{port}/hook?token={TOKEN}&page=2"
        async with turnstile("worker", ready=b"running slots", env=env) as worker:
            run = await queue.enqueue(
                NewRun(
                    tenant_id="t",
                    principal="p",
                    agent="scripted",
                    input={
                        "script": [
                            {"call": "http_request", "args": {"method": "GET", "url": url}},
                            {"final": "done"},
                        ]
                    },
                )
            )

            async def succeeded() -> bool:
                found = await queue.get_run(run.id)
                return found is not None and found.status == "succeeded"

            await eventually(succeeded, within=20, what="the run to succeed")
    assert hits == [TOKEN]  # the request itself went out whole
    output = worker.log.decode()
    assert TOKEN not in output
    assert PASSWORD not in output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    requests = [line["message"] for line in lines if line["logger"] == "httpx"]
    assert requests == [
        f'HTTP Request: GET http://127.0.0.1:{port}/hook?[redacted] "HTTP/1.1 200 OK"'
    ]
    assert not [line for line in lines if line["logger"].startswith("httpcore")]
