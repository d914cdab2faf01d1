"""Multitask policies through a real server (issue 33 item 1; docs/turn-control.md): the
session's policy and a turn's override, reject's 409, enqueue's pending turns (position,
bound, cancel, replay) promoted in every transaction that ends the run before them, interrupt
of a queued run at once and of a running one at its bound, and a run waiting for the user
taking any turn as its answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Lease, ToolCall
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[Api]:
    async with running_api(
        database_url, engine, clock=clock, max_pending_turns=3, interrupt_grace_seconds=5
    ) as running:
        yield running


async def new_session(client: httpx.AsyncClient, policy: str | None = None) -> str:
    body = {"multitask": policy} if policy else None
    response = await client.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["multitask"] == (policy or "reject")
    return str(response.json()["id"])


async def turn(
    client: httpx.AsyncClient, session: str, body: dict[str, Any], key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return await client.post(f"/sessions/{session}/turns", json=body, headers=headers)


async def claim(api: Api) -> Lease:
    [claimed] = await api.queue.claim("test-worker", list(PriorityClass))
    return claimed.lease


async def active_runs(engine: AsyncEngine, session: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id, status, session_run_no, input FROM runs WHERE session_id = :s "
                "AND status IN ('queued', 'running', 'waiting_for_user')"
            ),
            {"s": session},
        )
        return [dict(row) for row in rows.mappings()]


async def event_types(api: Api, run_id: str | UUID) -> list[str]:
    return [e.type for e in await api.queue.events(UUID(str(run_id)))]


async def test_the_policy_is_the_sessions_and_can_change(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    assert (await client.get(f"/sessions/{session}")).json()["multitask"] == "enqueue"
    changed = await client.patch(f"/sessions/{session}", json={"multitask": "steer"})
    assert changed.status_code == 200
    assert changed.json()["multitask"] == "steer"
    bad = await client.patch(f"/sessions/{session}", json={"multitask": "later"})
    assert bad.status_code == 422
    bad_turn = await turn(client, session, {"input": 1, "multitask": "sometimes"})
    assert bad_turn.status_code == 422
    # Another principal's session is not found, for a change as for a read.
    other = await api.client("acme", "bob")
    assert (
        await other.patch(f"/sessions/{session}", json={"multitask": "reject"})
    ).status_code == 404


async def test_reject_is_the_default_and_a_turn_may_insist_on_it(api: Api) -> None:
    client = await api.client()
    plain = await new_session(client)
    await turn(client, plain, {"input": 1})
    busy = await turn(client, plain, {"input": 2})
    assert busy.status_code == 409
    assert busy.json()["type"] == "/problems/session-busy"
    queuing = await new_session(client, "enqueue")
    await turn(client, queuing, {"input": 1})
    insisted = await turn(client, queuing, {"input": 2, "multitask": "reject"})
    assert insisted.status_code == 409
    # ...and a turn may ask for a policy its session does not have.
    asked = await turn(client, plain, {"input": 3, "multitask": "enqueue"})
    assert asked.status_code == 202
    assert asked.json()["kind"] == "pending_turn"


async def test_enqueued_turns_start_in_order_as_each_run_completes(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    first = (await turn(client, session, {"input": {"n": 1}})).json()
    second = await turn(client, session, {"input": {"n": 2}})
    assert second.status_code == 202
    pending = second.json()
    assert second.headers["location"] == f"/sessions/{session}/pending-turns/{pending['id']}"
    assert (pending["status"], pending["position"], pending["active_run_id"]) == (
        "pending",
        1,
        first["id"],
    )
    third = (await turn(client, session, {"input": {"n": 3}})).json()
    assert third["position"] == 2
    listed = (await client.get(f"/sessions/{session}/pending-turns")).json()["pending_turns"]
    assert [(t["id"], t["position"]) for t in listed] == [(pending["id"], 1), (third["id"], 2)]
    state = (await client.get(f"/sessions/{session}")).json()
    assert (state["state"], state["pending_turns"]) == ("busy", 2)
    assert "turn.pending" in await event_types(api, first["id"])

    # The run's completion starts the next turn in its own transaction.
    lease = await claim(api)
    await api.queue.complete(lease, {"ok": 1})
    [active] = await active_runs(api.engine, session)
    assert (active["input"], active["session_run_no"], active["status"]) == ({"n": 2}, 2, "queued")
    followed = (await client.get(f"/sessions/{session}/pending-turns/{pending['id']}")).json()
    assert (followed["status"], followed["run_id"], followed["position"]) == (
        "started",
        str(active["id"]),
        None,
    )
    # The run took the pending turn's own id (migration 0024): whoever followed the turn
    # follows the run under the id it already had.
    assert str(active["id"]) == pending["id"]
    third_now = (await client.get(f"/sessions/{session}/pending-turns/{third['id']}")).json()
    assert third_now["position"] == 1
    run = (await client.get(f"/runs/{active['id']}")).json()
    assert run["session_run_no"] == 2

    lease = await claim(api)
    await api.queue.complete(lease, {"ok": 2})
    [last] = await active_runs(api.engine, session)
    assert last["input"] == {"n": 3}
    lease = await claim(api)
    await api.queue.complete(lease, {"ok": 3})
    assert await active_runs(api.engine, session) == []
    assert (await client.get(f"/sessions/{session}")).json()["state"] == "idle"
    assert await check_all_runs(api.engine) == 3


@pytest.mark.parametrize("ending", ["fail", "cancel", "dead_letter", "waiting_then_cancel"])
async def test_every_end_of_the_run_starts_the_pending_turn(
    api: Api, clock: ManualClock, ending: str
) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    first = (await turn(client, session, {"input": {"n": 1}})).json()
    await turn(client, session, {"input": {"n": 2}})
    if ending == "fail":
        await api.queue.fail(await claim(api), {"kind": "boom", "message": "no"})
    elif ending == "cancel":
        assert (await client.post(f"/runs/{first['id']}/cancel")).status_code == 200
    elif ending == "dead_letter":
        async with api.engine.begin() as conn:
            await conn.execute(
                text("UPDATE runs SET max_attempts = 1 WHERE id = :i"), {"i": first["id"]}
            )
        await claim(api)
        clock.advance(3600)  # the worker died; its lease lapses on its last attempt
        assert (await api.queue.sweep()).failed == 1
    else:
        lease = await claim(api)
        await api.queue.wait_for_user(lease, "which?", step=1, state={})
        # Waiting is not an end: the pending turn stays behind the run...
        assert [r["id"] for r in await active_runs(api.engine, session)] == [UUID(first["id"])]
        assert (await client.post(f"/runs/{first['id']}/cancel")).status_code == 200
    [active] = await active_runs(api.engine, session)
    assert active["input"] == {"n": 2}
    assert await check_all_runs(api.engine) == 2


async def test_a_run_waiting_for_the_user_takes_any_turn_as_its_answer(api: Api) -> None:
    client = await api.client()
    for policy in ("enqueue", "interrupt", "steer"):
        session = await new_session(client, policy)
        first = (await turn(client, session, {"input": 1})).json()
        lease = await claim(api)
        await api.queue.wait_for_user(lease, "which?", step=1, state={})
        answered = await turn(client, session, {"input": "this one"})
        assert answered.status_code == 202
        assert (answered.json()["id"], answered.json()["status"]) == (first["id"], "queued")
        assert (await client.get(f"/sessions/{session}/pending-turns")).json() == {
            "pending_turns": []
        }
        await api.queue.cancel(UUID(first["id"]), actor="test")


async def test_the_bound_of_pending_turns_answers_429(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    await turn(client, session, {"input": 0})
    for n in range(3):
        assert (await turn(client, session, {"input": n + 1})).status_code == 202
    full = await turn(client, session, {"input": 4})
    assert full.status_code == 429
    body = full.json()
    assert (body["type"], body["max_pending"]) == ("/problems/too-many-pending-turns", 3)
    async with api.engine.connect() as conn:
        count = await conn.execute(text("SELECT count(*) FROM pending_turns"))
        assert count.scalar_one() == 3  # nothing written


async def test_a_pending_turn_can_be_withdrawn_until_it_starts(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    first = (await turn(client, session, {"input": 1})).json()
    withdrawn = (await turn(client, session, {"input": 2})).json()
    kept = (await turn(client, session, {"input": 3})).json()
    cancel = f"/sessions/{session}/pending-turns/{withdrawn['id']}/cancel"
    response = await client.post(cancel)
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert (await client.post(cancel)).json()["status"] == "cancelled"  # idempotent
    assert "turn.cancelled" in await event_types(api, first["id"])
    await api.queue.complete(await claim(api), {"ok": 1})
    [active] = await active_runs(api.engine, session)
    assert active["input"] == 3  # the withdrawn turn never ran
    late = await client.post(f"/sessions/{session}/pending-turns/{kept['id']}/cancel")
    assert late.status_code == 409
    assert (late.json()["type"], late.json()["run_id"]) == (
        "/problems/turn-started",
        str(active["id"]),
    )
    missing = await client.post(f"/sessions/{session}/pending-turns/{first['id']}/cancel")
    assert missing.status_code == 404


async def test_an_enqueued_turn_is_idempotent(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    await turn(client, session, {"input": 1})
    once = await turn(client, session, {"input": 2}, key="k2")
    again = await turn(client, session, {"input": 2}, key="k2")
    assert again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == once.json()["id"]
    assert again.headers["location"] == once.headers["location"]
    assert once.headers["location"].endswith(f"/pending-turns/{once.json()['id']}")
    steer = await turn(client, session, {"input": 3, "multitask": "steer"}, key="k3")
    steer_again = await turn(client, session, {"input": 3, "multitask": "steer"}, key="k3")
    assert steer_again.headers["location"] == steer.headers["location"]
    assert steer_again.json()["pending_turn"]["id"] == steer.json()["pending_turn"]["id"]
    listed = (await client.get(f"/sessions/{session}/pending-turns")).json()["pending_turns"]
    assert len(listed) == 2


async def test_an_interrupt_of_a_queued_run_starts_the_turn_at_once(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    first = (await turn(client, session, {"input": 1})).json()
    response = await turn(client, session, {"input": 2, "multitask": "interrupt"})
    assert response.status_code == 202
    new = response.json()
    assert response.headers["location"] == f"/runs/{new['id']}"
    assert (new["status"], new["session_run_no"]) == ("queued", 2)
    old = (await client.get(f"/runs/{first['id']}")).json()
    assert old["status"] == "cancelled"
    events = await api.queue.events(UUID(first["id"]))
    assert [e.type for e in events][-3:] == ["turn.pending", "run.interrupted", "run.cancelled"]
    assert events[-1].data["reason"] == "interrupted"
    assert events[-2].data["policy"] == "interrupt"
    assert await check_all_runs(api.engine) == 2


async def test_an_interrupt_goes_ahead_of_enqueued_turns(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "enqueue")
    await turn(client, session, {"input": 1})
    lease = await claim(api)
    # The worker dies inside an unsafe call: past the interrupt's bound the sweep ends the run.
    await api.queue.tool_started(
        lease, ToolCall(step=1, tool="send_email", idempotency_class="unsafe", args={})
    )
    await turn(client, session, {"input": "queued behind"})
    interrupting = (await turn(client, session, {"input": "now", "multitask": "interrupt"})).json()
    assert interrupting["position"] == 1
    assert interrupting["interrupt_by"] is not None
    assert await api.queue.sweep_turns() == 0  # not yet
    api_clock = api.queue.clock
    assert isinstance(api_clock, ManualClock)
    api_clock.advance(6)
    assert await api.queue.sweep_turns() == 1
    events = await api.queue.events(lease.run_id)
    assert [e.type for e in events][-4:] == [
        "turn.pending",
        "run.interrupted",
        "tool.finished",
        "run.cancelled",
    ]
    assert events[-2].data["outcome_status"] == "uncertain"
    assert events[-3].data["by"] == "deadline"
    [active] = await active_runs(api.engine, session)
    assert active["input"] == "now"
    # The enqueued turn follows the interrupting one.
    await api.queue.complete(await claim(api), {"ok": 1})
    [active] = await active_runs(api.engine, session)
    assert active["input"] == "queued behind"
    assert await check_all_runs(api.engine) == 3


async def test_a_steer_reaches_the_running_run_at_its_next_boundary(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "steer")
    first = (await turn(client, session, {"input": 1})).json()
    lease = await claim(api)
    steered = await turn(client, session, {"input": {"text": "and in French"}})
    assert steered.status_code == 202
    body = steered.json()
    assert (body["id"], steered.headers["location"]) == (first["id"], f"/runs/{first['id']}")
    assert (body["pending_turn"]["policy"], body["pending_turn"]["status"]) == ("steer", "pending")
    assert await api.queue.turn_signals(UUID(session)) == (None, True)
    taken = await api.queue.take_steered(lease, at_step=1)
    assert taken == [{"text": "and in French"}]
    assert await api.queue.turn_signals(UUID(session)) == (None, False)
    assert await api.queue.take_steered(lease, at_step=1) == []  # nothing twice
    events = await api.queue.events(lease.run_id)
    delivered = [e for e in events if e.type == "run.input_delivered"]
    assert [(e.data["policy"], e.data["input_index"]) for e in delivered] == [("steer", 2)]
    assert await api.queue.steered_inputs(lease.run_id) == [({"text": "and in French"}, 2, 1)]
    followed = (
        await client.get(f"/sessions/{session}/pending-turns/{body['pending_turn']['id']}")
    ).json()
    assert (followed["status"], followed["run_id"]) == ("delivered", first["id"])
    await api.queue.complete(lease, {"ok": 1})
    assert await active_runs(api.engine, session) == []  # nothing left to start
    # The transcript has the steered input as the user's, within the same run.
    messages = (await client.get(f"/sessions/{session}/messages")).json()["items"]
    assert [(m["run_no"], m["role"], m["content"]) for m in messages if m["role"] == "user"] == [
        (1, "user", 1),
        (1, "user", {"text": "and in French"}),
    ]
    assert await check_all_runs(api.engine) == 1


async def test_a_steer_that_arrives_as_the_run_ends_becomes_the_next_run(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "steer")
    await turn(client, session, {"input": 1})
    lease = await claim(api)
    steered = (await turn(client, session, {"input": "too late"})).json()
    # The run finishes without another boundary: the steer is not lost.
    await api.queue.complete(lease, {"ok": 1})
    [active] = await active_runs(api.engine, session)
    assert (active["input"], active["session_run_no"]) == ("too late", 2)
    followed = (
        await client.get(f"/sessions/{session}/pending-turns/{steered['pending_turn']['id']}")
    ).json()
    assert (followed["status"], followed["run_id"]) == ("started", str(active["id"]))
    assert str(active["id"]) == steered["pending_turn"]["id"]  # the next run has its id
    assert await check_all_runs(api.engine) == 2


async def test_a_worker_that_finds_an_interrupt_at_its_boundary_stops_there(api: Api) -> None:
    client = await api.client()
    session = await new_session(client, "interrupt")
    await turn(client, session, {"input": 1})
    lease = await claim(api)
    pending = (await turn(client, session, {"input": "stop that"})).json()
    interrupt, _ = await api.queue.turn_signals(UUID(session))
    assert interrupt == UUID(pending["id"])
    assert await api.queue.interrupt(lease.run_id, turn_id=interrupt, by="worker")
    assert not await api.queue.interrupt(lease.run_id, turn_id=interrupt, by="worker")
    events = await api.queue.events(lease.run_id)
    assert [e.type for e in events][-2:] == ["run.interrupted", "run.cancelled"]
    assert events[-2].data == {
        "policy": "interrupt",
        "pending_turn_id": pending["id"],
        "by": "worker",
    }
    [active] = await active_runs(api.engine, session)
    assert active["input"] == "stop that"
    # The interrupted worker's next write is fenced.
    assert not await api.queue.heartbeat(lease)
    assert await check_all_runs(api.engine) == 2


async def test_a_turn_naming_its_policy_keeps_its_deadline_in_an_idle_session(
    api: Api, clock: ManualClock
) -> None:
    """A turn with its own `multitask` takes the policy path even when its session is idle:
    the run it makes there must carry the turn's deadline to start, as the one-round-trip
    path's does (docs/start-deadlines.md)."""
    client = await api.client()
    for policy in ("enqueue", "interrupt", "steer"):
        session = await new_session(client)
        response = await turn(
            client, session, {"input": policy, "multitask": policy, "start_within": 30}
        )
        assert response.status_code == 202, response.text
        run = (await client.get(f"/runs/{response.json()['id']}")).json()
        assert run["start_before"] is not None, policy
        assert datetime.fromisoformat(run["start_before"]) == clock.now + timedelta(seconds=30)
    at = clock.now + timedelta(minutes=5)
    session = await new_session(client)
    response = await turn(
        client, session, {"input": 0, "multitask": "enqueue", "start_before": at.isoformat()}
    )
    run = (await client.get(f"/runs/{response.json()['id']}")).json()
    assert datetime.fromisoformat(run["start_before"]) == at
    # A deadline long past is refused on this path as on the other, and writes nothing.
    idle = await new_session(client)
    gone = clock.now - timedelta(minutes=5)
    refused = await turn(
        client, idle, {"input": 1, "multitask": "enqueue", "start_before": gone.isoformat()}
    )
    assert refused.status_code == 422, refused.text
    assert refused.json()["errors"][0]["loc"][:2] == ["body", "start_before"]
    assert await active_runs(api.engine, idle) == []
