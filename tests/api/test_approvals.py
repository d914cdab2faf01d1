"""Which calls wait for approval, over HTTP with the worker pool in the API's process (issue 33
item 2; docs/approvals.md): the process default (TURNSTILE_APPROVAL_REQUIRED), a session's
policy (POST and PATCH /sessions), and a turn's or a run's own (`approval` in the turn body and
POST /runs), each overriding the one before; a sessionless run answered at POST
/runs/{id}/approval; the `run.waiting` webhook carrying the request; bad input as problems."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.vocabulary.approval_policy import ApprovalPolicy, effective, parse_default, schema_errors
from tests.support.api import Api, running_api
from tests.support.waiting import eventually
from tests.support.webhook_receiver import receiver

HOOKS: dict[str, Any] = {
    "secret_key": "k" * 40,
    "http_allowed_hosts": "127.0.0.1",
    "webhook_backoff_base_seconds": 0.05,
    "webhook_backoff_max_seconds": 0.2,
}
ECHO = {"script": [{"call": "echo", "args": {"n": 1}}, {"call": "sleep", "args": {"seconds": 0}}]}


async def waiting_request(api: Api, run_id: str) -> dict[str, Any] | None:
    run = await api.queue.get_run(UUID(run_id))
    assert run is not None
    request = run.approval_request
    return request if isinstance(request, dict) else None


async def finished(api: Api, run_id: str) -> Any:
    run = await api.queue.get_run(UUID(run_id))
    assert run is not None
    return run if run.status in ("succeeded", "failed") else None


async def settle(api: Api, client: httpx.AsyncClient, run_id: str) -> list[str]:
    """Approve every call the run asks for until it ends; the tools asked for, in order."""
    asked: list[str] = []
    while True:

        async def next_step() -> Any:
            return await waiting_request(api, run_id) or await finished(api, run_id)

        seen = await eventually(next_step, within=30, what="a request or the end")
        if not isinstance(seen, dict):
            assert seen.status == "succeeded", seen.failure
            return asked
        asked.append(seen["tool"])
        answer = await client.post(
            f"/runs/{run_id}/approval", json={"call_id": seen["call_id"], "decision": "approve"}
        )
        assert answer.status_code == 202, answer.text


async def test_the_turn_overrides_the_session_which_overrides_the_default(
    database_url: str, engine: AsyncEngine
) -> None:
    async with (
        receiver() as hook,
        running_api(database_url, engine, workers=True, approval_required="echo", **HOOKS) as api,
    ):
        ops = await api.client("acme", "ops", "operator")
        created = await ops.post("/webhooks", json={"url": hook.url, "events": ["run.waiting"]})
        assert created.status_code == 201, created.text
        client = await api.client()

        # The process default: a sessionless run's echo waits, its sleep does not.
        run = (await client.post("/runs", json={"input": ECHO})).json()
        assert await settle(api, client, run["id"]) == ["echo"]
        # A run's own policy overrides the default: here, none at all.
        run = (await client.post("/runs", json={"input": ECHO, "approval": {}})).json()
        assert await settle(api, client, run["id"]) == []

        # A session's policy overrides the default; a turn's overrides the session's.
        session = (await client.post("/sessions", json={"approval": {"tools": ["sleep"]}})).json()
        assert session["approval"] == {"tools": ["sleep"], "classes": []}
        sid = session["id"]
        turn = (await client.post(f"/sessions/{sid}/turns", json={"input": ECHO})).json()
        assert await settle(api, client, turn["id"]) == ["sleep"]
        body = {"input": ECHO, "approval": {"classes": ["safe"]}}
        turn = (await client.post(f"/sessions/{sid}/turns", json=body)).json()
        assert await settle(api, client, turn["id"]) == ["echo", "sleep"]
        # PATCH null: back to the process default.
        patched = await client.patch(f"/sessions/{sid}", json={"approval": None})
        assert patched.status_code == 200
        assert patched.json()["approval"] is None
        turn = (await client.post(f"/sessions/{sid}/turns", json={"input": ECHO})).json()
        assert await settle(api, client, turn["id"]) == ["echo"]

        # The run.waiting webhook carries the request.
        async def delivered() -> Any:
            return len(hook.deliveries) >= 5 or None

        await eventually(delivered, within=30, what="the run.waiting deliveries")
        data = [d.json["data"] for d in hook.deliveries]
        assert all(d["approval_request"]["call_id"] for d in data)
        assert {d["approval_request"]["tool"] for d in data} == {"echo", "sleep"}
        assert all(d["question"]["approval_request"] == d["approval_request"] for d in data)


async def test_bad_policies_and_answers_are_problems_and_write_nothing(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        for body in (
            {"approval": {"classes": ["dangerous"]}},
            {"approval": {"tools": ["no spaces please"]}},
            {"approval": {"tools": "echo"}},
            {"approval": {"tools": [], "other": 1}},
        ):
            refused = await client.post("/sessions", json=body)
            assert refused.status_code == 422, body
            assert refused.headers["content-type"].startswith("application/problem+json")
        sid = (await client.post("/sessions")).json()["id"]
        for body in (
            {"approval": {"call_id": "x", "decision": "approve"}, "agent": "scripted"},
            {"approval": {"call_id": "", "decision": "approve"}},
            {"approval": {"call_id": "x", "decision": "reject", "reason": "r" * 2001}},
            {"approval": {"classes": ["unsafe"]}},  # a policy still needs an input
        ):
            refused = await client.post(f"/sessions/{sid}/turns", json=body)
            assert refused.status_code == 422, body
        # An approval to a session with no run waiting for one.
        approve = {"approval": {"call_id": "x", "decision": "approve"}}
        idle = await client.post(f"/sessions/{sid}/turns", json=approve)
        assert idle.status_code == 409
        assert idle.json()["type"] == "/problems/no-approval-pending"
        missing = await client.post(
            "/runs/00000000-0000-0000-0000-000000000000/approval",
            json={"call_id": "x", "decision": "approve"},
        )
        assert missing.status_code == 404
        assert (await client.get(f"/sessions/{sid}/runs")).json()["runs"] == []


def test_the_default_policy_syntax() -> None:
    assert parse_default("") == ApprovalPolicy()
    assert parse_default(" http_request , class:unsafe,class:keyed") == ApprovalPolicy(
        frozenset({"http_request"}), frozenset({"unsafe", "keyed"})
    )
    for bad in ("class:risky", "two words"):
        with pytest.raises(ValueError, match=bad.split()[0]):
            parse_default(bad)
    with pytest.raises(ValueError, match=r"class:risky"):
        Settings(approval_required="class:risky")
    default = parse_default("echo")
    assert effective(None, None, default) == default
    assert effective(None, {"tools": ["sleep"]}, default).tools == {"sleep"}
    assert effective({}, {"tools": ["sleep"]}, default) == ApprovalPolicy()


def test_edited_arguments_are_checked_against_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "seconds": {"type": "number", "minimum": 0, "maximum": 60},
            "mode": {"enum": ["a", "b"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["seconds"],
        "additionalProperties": False,
    }
    assert schema_errors({"seconds": 1, "mode": "a", "tags": ["x"]}, schema) == []
    errors = schema_errors({"seconds": 61, "mode": "c", "tags": ["x", 2, "z"], "y": 1}, schema)
    assert sorted(e["type"] for e in errors) == [
        "enum",
        "extra_forbidden",
        "maxItems",
        "maximum",
        "type",
    ]
    assert schema_errors({}, schema)[0]["loc"] == ["body", "approval", "args", "seconds"]
    assert schema_errors({"seconds": True}, schema)[0]["type"] == "type"
