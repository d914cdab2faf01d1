"""The Python client's approval helpers (`approve`, `reject`, `edit`, `set_approval`, the
`approval` of sessions, turns and runs; the server's docs/approvals.md), against the API with
its worker pool: each decision resumes the same run, a retry with the same key replays it, and
the problems are the client's own exceptions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from turnstile_client import (
    ApprovalPendingError,
    AsyncTurnstile,
    InvalidApprovalError,
    NoApprovalPendingError,
    Turnstile,
)

from tests.support.api import Api, running_api

SCRIPT = {
    "script": [
        {"call": "sleep", "args": {"seconds": 5}},
        {"call": "echo", "args": {"to": "ada"}},
        {"final": "done"},
    ]
}


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True) as running:
        yield running


async def test_approve_edit_and_reject_resume_the_same_run(api: Api) -> None:
    async with AsyncTurnstile(api.base, await api.key()) as turnstile:
        session = await turnstile.create_session(approval={"tools": ["sleep", "echo"]})
        assert session.approval == {"tools": ["echo", "sleep"], "classes": []}
        run = await turnstile.submit_turn(session, SCRIPT)
        asked = await turnstile.wait(run, timeout=30)
        assert asked.approval_request is not None
        assert asked.approval_request["tool"] == "sleep"
        assert (await turnstile.get_session(session)).approval_request == asked.approval_request
        with pytest.raises(ApprovalPendingError) as pending:
            await turnstile.submit_turn(session, "hello?")
        assert pending.value.call_id == asked.approval_request["call_id"]
        with pytest.raises(InvalidApprovalError):
            await turnstile.edit(asked, {"seconds": -1})
        edited = await turnstile.edit(asked, {"seconds": 0.01}, idempotency_key="edit-1")
        assert edited.id == asked.id
        assert edited.status == "queued"
        again = await turnstile.edit(asked, {"seconds": 0.01}, idempotency_key="edit-1")
        assert again.id == edited.id  # replayed, not refused
        second = await turnstile.wait(edited, timeout=30)
        assert second.approval_request is not None
        assert second.approval_request["tool"] == "echo"
        with pytest.raises(NoApprovalPendingError):
            await turnstile.approve(second, call_id=f"{second.id}.9")
        done = await turnstile.wait(await turnstile.reject(second, "not to Ada"), timeout=30)
    assert done.status == "succeeded"
    assert isinstance(done.result, dict)
    assert [t["status"] for t in done.result["tool_outcomes"]] == ["succeeded", "rejected"]
    assert done.result["tool_outcomes"][1]["outcome"]["reason"] == "not to Ada"


async def test_the_blocking_client_approves_a_sessionless_run(api: Api) -> None:
    key = await api.key()

    def use() -> tuple[str, str | None]:
        with Turnstile(api.base, key) as turnstile:
            run = turnstile.submit_run(SCRIPT, approval={"tools": ["echo"]})
            asked = turnstile.wait(run, timeout=30)
            assert asked.approval_request is not None
            done = turnstile.wait(turnstile.approve(asked), timeout=30)
            session = turnstile.create_session()
            changed = turnstile.set_approval(session, {"classes": ["unsafe"]})
            return done.status, str(changed.approval)

    status, policy = await asyncio.to_thread(use)
    assert status == "succeeded"
    assert policy == str({"tools": [], "classes": ["unsafe"]})
