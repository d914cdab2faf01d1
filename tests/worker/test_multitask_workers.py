"""Multitask policies against a real `turnstile worker` process (issue 33 item 1;
docs/turn-control.md): an enqueued turn starts when the run before it succeeds and sees its
transcript; an interrupt stops a run that is running a tool at its next boundary; a steer
reaches the running run, which records it in its result; and a worker SIGKILLed with an
interrupt pending does not hold the interrupt up past its bound."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any
from uuid import UUID

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.records import Run
from tests.support.api import Api, running_api
from tests.support.invariants import check_all_runs
from tests.support.processes import Child, turnstile
from tests.support.waiting import eventually


def worker_process(database_url: str) -> AbstractAsyncContextManager[Child]:
    return turnstile(
        "worker",
        ready=b"running slots",
        env={
            "DATABASE_URL": database_url,
            "TURNSTILE_POLL_INTERVAL_SECONDS": "60",
            "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
        },
    )


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    # The bound is long: a run that stops before it stopped at a boundary, not by the sweep.
    async with running_api(database_url, engine, interrupt_grace_seconds=120) as running:
        yield running


async def session_with(client: httpx.AsyncClient, policy: str) -> str:
    response = await client.post("/sessions", json={"multitask": policy})
    assert response.status_code == 201
    return str(response.json()["id"])


async def turn(client: httpx.AsyncClient, session: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"/sessions/{session}/turns", json=body)
    assert response.status_code == 202, response.text
    result: dict[str, Any] = response.json()
    return result


async def run_of(api: Api, run_id: str | UUID) -> Run:
    run = await api.queue.get_run(UUID(str(run_id)))
    assert run is not None
    return run


async def ended(api: Api, run_id: str | UUID) -> Run | None:
    run = await run_of(api, run_id)
    return run if run.status in ("succeeded", "failed", "cancelled") else None


async def tool_started(api: Api, run_id: str | UUID) -> bool:
    return "tool.started" in [e.type for e in await api.queue.events(UUID(str(run_id)))]


async def test_an_enqueued_turn_follows_the_run_and_sees_its_transcript(
    api: Api, database_url: str
) -> None:
    client = await api.client()
    session = await session_with(client, "enqueue")
    async with worker_process(database_url):
        first = await turn(
            client,
            session,
            {
                "input": {
                    "script": [{"call": "sleep", "args": {"seconds": 1}}, {"final": "first done"}]
                }
            },
        )
        pending = await turn(client, session, {"input": {"echo_history": True}})
        assert pending["kind"] == "pending_turn"
        await eventually(lambda: ended(api, first["id"]), within=30, what="the first run")

        async def started() -> str | None:
            doc = (await client.get(f"/sessions/{session}/pending-turns/{pending['id']}")).json()
            return doc["run_id"] if doc["status"] == "started" else None

        second_id = await eventually(started, within=10, what="the pending turn's run")
        second = await eventually(lambda: ended(api, second_id), within=30, what="the second run")
    assert second.status == "succeeded"
    assert isinstance(second.result, dict)
    history = second.result["history"]
    assert [(h["run_no"], h["role"], h["kind"]) for h in history][-1] == (1, "assistant", "final")
    assert any(h["kind"] == "tool_call" for h in history)
    assert await check_all_runs(api.engine) == 2


async def test_an_interrupt_stops_a_run_running_a_tool_at_its_next_boundary(
    api: Api, database_url: str
) -> None:
    client = await api.client()
    session = await session_with(client, "interrupt")
    script = [{"call": "sleep", "args": {"seconds": 1}}] * 5 + [{"final": "never"}]
    async with worker_process(database_url):
        first = await turn(client, session, {"input": {"script": script}})
        await eventually(lambda: tool_started(api, first["id"]), within=30, what="a tool call")
        pending = await turn(client, session, {"input": "stop, do this instead"})
        assert pending["kind"] == "pending_turn"
        stopped = await eventually(lambda: ended(api, first["id"]), within=30, what="the stop")
        assert stopped.status == "cancelled"
        events = await api.queue.events(stopped.id)
        types = [e.type for e in events]
        interrupted = events[types.index("run.interrupted")]
        assert interrupted.data["by"] == "worker"  # at a boundary, not by the sweep's bound
        assert events[-1].data["reason"] == "interrupted"
        # At a boundary: every call it started has its own outcome, none settled by the cancel.
        assert types.count("tool.started") == types.count("tool.finished")
        assert all("by" not in e.data for e in events if e.type == "tool.finished")
        assert "run.succeeded" not in types

        async def next_run() -> Run | None:
            doc = (await client.get(f"/sessions/{session}/pending-turns/{pending['id']}")).json()
            return await ended(api, doc["run_id"]) if doc["run_id"] else None

        after = await eventually(next_run, within=30, what="the interrupting turn's run")
    assert after.status == "succeeded"
    assert await check_all_runs(api.engine) == 2


async def test_a_steer_reaches_the_running_run(api: Api, database_url: str) -> None:
    client = await api.client()
    session = await session_with(client, "steer")
    script = [{"call": "sleep", "args": {"seconds": 1}}, {"call": "echo", "args": {}}]
    async with worker_process(database_url):
        first = await turn(client, session, {"input": {"script": [*script, {"final": "ok"}]}})
        await eventually(lambda: tool_started(api, first["id"]), within=30, what="a tool call")
        steered = await turn(client, session, {"input": {"text": "mind the budget"}})
        assert steered["id"] == first["id"]
        done = await eventually(lambda: ended(api, first["id"]), within=30, what="the run")
    assert done.status == "succeeded"
    assert isinstance(done.result, dict)
    # Taken at a boundary of the run it steered; or, had the run ended first, its next run.
    if "steered" in done.result:
        assert done.result["steered"] == [{"text": "mind the budget"}]
    else:
        doc = (
            await client.get(f"/sessions/{session}/pending-turns/{steered['pending_turn']['id']}")
        ).json()
        assert doc["status"] == "started"
    assert await check_all_runs(api.engine) >= 1


async def test_a_worker_killed_with_an_interrupt_pending_does_not_hold_it_up(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, interrupt_grace_seconds=1) as api:
        client = await api.client()
        session = await session_with(client, "interrupt")
        script = [{"call": "sleep", "args": {"seconds": 30}}, {"final": "never"}]
        async with worker_process(database_url) as worker:
            first = await turn(client, session, {"input": {"script": script}})
            await eventually(lambda: tool_started(api, first["id"]), within=30, what="the call")
            pending = await turn(client, session, {"input": "instead"})
            worker.process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(worker.process.wait(), 30)

        # Past the bound the sweep ends the run, whatever its lease says (the worker is dead).
        async def swept() -> bool:
            return await api.queue.sweep_turns() == 1

        await eventually(swept, within=30, what="the interrupt's bound")
        run = await run_of(api, first["id"])
        assert run.status == "cancelled"
        events = await api.queue.events(run.id)
        interrupted = [e for e in events if e.type == "run.interrupted"]
        assert [e.data["by"] for e in interrupted] == ["deadline"]
        # The sleep (safe) it left open is settled as abandoned, with its event.
        settled = [e for e in events if e.type == "tool.finished"]
        assert [e.data["outcome_status"] for e in settled] == ["abandoned"]
        doc = (await client.get(f"/sessions/{session}/pending-turns/{pending['id']}")).json()
        assert doc["status"] == "started"
        assert (await run_of(api, doc["run_id"])).status == "queued"
        assert await check_all_runs(api.engine) == 2
