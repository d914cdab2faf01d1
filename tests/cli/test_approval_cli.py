"""`turnstile runs approve|reject|edit` (docs/approvals.md): an operator's decision on the tool
call a run waits for, from the command line; a bad one is one line, never a traceback."""

from __future__ import annotations

import json
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.processes import run_cli
from tests.support.waiting import eventually


async def test_edit_then_reject_from_the_cli(database_url: str, engine: AsyncEngine) -> None:
    env = {"DATABASE_URL": database_url}
    script = {
        "script": [
            {"call": "sleep", "args": {"seconds": 5}},
            {"call": "echo", "args": {"x": 1}},
            {"final": "done"},
        ]
    }
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        body = {"input": script, "approval": {"tools": ["sleep", "echo"]}}
        run_id = (await client.post("/runs", json=body)).json()["id"]

        async def asking(tool: str) -> bool:
            run = await api.queue.get_run(UUID(run_id))
            assert run is not None
            request = run.approval_request
            return isinstance(request, dict) and request["tool"] == tool

        await eventually(lambda: asking("sleep"), within=30, what="the sleep's request")
        code, _, err = await run_cli("runs", "edit", run_id, "--args", "[1]", env=env)
        assert code != 0
        assert err.strip().count("\n") == 0, err
        assert "JSON object" in err, err
        code, _, err = await run_cli("runs", "edit", run_id, "--args", '{"seconds": -1}', env=env)
        assert code != 0
        assert "Traceback" not in err, err
        assert "seconds" in err, err
        code, out, err = await run_cli(
            "runs", "edit", run_id, "--args", '{"seconds": 0}', "--json", env=env
        )
        assert code == 0, err
        assert json.loads(out)["status"] == "queued"
        await eventually(lambda: asking("echo"), within=30, what="the echo's request")
        code, out, err = await run_cli("runs", "reject", run_id, "--reason", "no", env=env)
        assert code == 0, err

        async def done() -> bool:
            run = await api.queue.get_run(UUID(run_id))
            return run is not None and run.status == "succeeded"

        await eventually(done, within=30, what="the run")
        code, _, err = await run_cli("runs", "approve", run_id, env=env)
        assert code != 0
        assert "waiting for no approval" in err, err
