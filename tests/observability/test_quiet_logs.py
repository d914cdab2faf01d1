"""A worker's log at the default level has no line per outbound request (issue 41 item 2): a
real `turnstile worker` runs `openai` runs against a loopback model and a scripted run whose
`http_request` call reaches a loopback server; its log names neither request. (httpx logged an
info line for every model request: 6,785 lines for one drain of 6,000 runs.) At debug level the
HTTP client's lines return, redacted (tests/observability/test_logs.py)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

from app.queue.core import Queue
from app.vocabulary.records import NewRun
from tests.support.processes import turnstile
from tests.support.servers import running_server
from tests.support.waiting import eventually

ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "model": "fake",
    "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
    ],
}
RUNS = 5


async def test_a_worker_at_the_default_level_logs_no_line_per_outbound_request(
    database_url: str, engine: Any
) -> None:
    calls: list[str] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete() -> dict[str, Any]:
        calls.append("model")
        return ANSWER

    @app.get("/page")
    async def page() -> dict[str, bool]:
        calls.append("page")
        return {"ok": True}

    async with running_server(app) as base:
        port = base.rsplit(":", 1)[1]
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_OPENAI_BASE_URL": f"{base}/v1",
            "TURNSTILE_HTTP_ALLOWED_HOSTS": f"127.0.0.1:{port}",
        }
        queue = Queue(engine)
        async with turnstile("worker", ready=b"running slots", env=env) as worker:
            runs = [
                await queue.enqueue(
                    NewRun(tenant_id="t", principal="p", agent="openai", input={"text": "hi"})
                )
                for _ in range(RUNS)
            ]
            runs.append(
                await queue.enqueue(
                    NewRun(
                        tenant_id="t",
                        principal="p",
                        agent="scripted",
                        input={
                            "script": [
                                {
                                    "call": "http_request",
                                    "args": {"method": "GET", "url": f"{base}/page"},
                                },
                                {"final": "done"},
                            ]
                        },
                    )
                )
            )

            async def all_succeeded() -> bool:
                found = [await queue.get_run(r.id) for r in runs]
                return all(f is not None and f.status == "succeeded" for f in found)

            await eventually(all_succeeded, within=30, what="every run to succeed")
    assert sorted(calls) == ["model"] * RUNS + ["page"]
    output = worker.log.decode()  # complete: the worker drained and exited 0
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert lines, output
    outbound = [
        line
        for line in lines
        if line["logger"].split(".")[0] in ("httpx", "httpcore", "aiohttp")
        or "/chat/completions" in line["message"]
        or "/page" in line["message"]
    ]
    assert outbound == []
