"""Your own agent (issue 38 item 3): examples/my_agent.py, loaded through TURNSTILE_PLUGINS from
its own folder by the installed `turnstile serve` (no PYTHONPATH), asks the user, calls a tool
and succeeds; the unconfigured `openai` agent's refusal names the setting that enables it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import create_key
from app.store.embedded import free_port
from tests.support.processes import turnstile
from tests.support.waiting import eventually

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_the_example_agent_runs_from_its_folder(
    database_url: str, engine: AsyncEngine
) -> None:
    key = (await create_key(engine, tenant_id="acme", principal="ada")).secret
    port = free_port()
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_PLUGINS": "my_agent:register",
        "TURNSTILE_OPENAI_BASE_URL": "",
    }
    # The console script, not `python -m`: its path holds no current folder of its own.
    program = (str(Path(sys.executable).parent / "turnstile"),)
    async with (
        turnstile(
            "serve",
            "--port",
            str(port),
            ready=b"Uvicorn running",
            env=env,
            program=program,
            cwd=str(EXAMPLES),
        ),
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as client,
    ):
        session = (await client.post("/sessions")).json()["id"]
        turn = await client.post(
            f"/sessions/{session}/turns", json={"agent": "greeter", "input": "hello"}
        )
        assert turn.status_code == 202, turn.text
        run = turn.json()["id"]

        async def run_in(status: str) -> dict[str, Any] | None:
            body: dict[str, Any] = (await client.get(f"/runs/{run}")).json()
            return body if body["status"] == status else None

        waiting = await eventually(
            lambda: run_in("waiting_for_user"), within=60, what="its question"
        )
        assert waiting["question"] == "What is your name?"
        answer = await client.post(f"/sessions/{session}/turns", json={"input": "Ada"})
        assert answer.status_code == 202, answer.text
        assert answer.json()["id"] == run
        done = await eventually(lambda: run_in("succeeded"), within=60, what="its success")
        assert done["result"] == {"echo": {"greeting": "Hello, Ada!"}}

        refused = await client.post(
            f"/sessions/{session}/turns", json={"agent": "openai", "input": "hi"}
        )
        assert refused.status_code == 422
        assert "TURNSTILE_OPENAI_BASE_URL" in refused.json()["detail"]
