"""The HTTP API through a real server: turn routing (new run, delivery to a waiting run,
session-busy), idempotency (replay, reuse, concurrency, in-flight, expiry, only 2xx stored),
tenancy, long poll, ETag, events and Server-Sent Events, cancel, and the operator runbook."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import httpx
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

import app.api.runs
import app.api.watch
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Lease
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.waiting import eventually


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, idempotency_wait_seconds=0.5) as running:
        yield running


async def new_session(client: httpx.AsyncClient) -> str:
    response = await client.post("/sessions")
    assert response.status_code == 201
    assert response.headers["location"] == f"/sessions/{response.json()['id']}"
    return str(response.json()["id"])


async def turn(
    client: httpx.AsyncClient, session: str, body: dict[str, Any], key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return await client.post(f"/sessions/{session}/turns", json=body, headers=headers)


async def claim(api: Api) -> Lease:
    claimed = await api.queue.claim("test-worker", list(PriorityClass))
    assert len(claimed) == 1
    return claimed[0].lease


async def count_runs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one())


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{slug}"
    assert body["status"] == status
    return body


# --- routing -----------------------------------------------------------------------------------
async def test_a_turn_on_an_idle_session_starts_a_run(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    response = await turn(client, session, {"input": {"text": "hello"}})
    assert response.status_code == 202
    run = response.json()
    assert response.headers["location"] == f"/runs/{run['id']}"
    assert (run["status"], run["class"], run["agent"], run["session_id"]) == (
        "queued",
        "interactive",
        "scripted",
        session,
    )
    state = (await client.get(f"/sessions/{session}")).json()
    assert (state["state"], state["active_run_id"]) == ("busy", run["id"])


@pytest.mark.parametrize("active", ["queued", "running"])
async def test_a_turn_while_a_run_is_active_is_refused(api: Api, active: str) -> None:
    client = await api.client()
    session = await new_session(client)
    first = (await turn(client, session, {"input": 1})).json()
    if active == "running":
        await claim(api)
    busy = assert_problem(await turn(client, session, {"input": 2}), 409, "session-busy")
    assert busy["active_run_id"] == first["id"]
    assert busy["active_run_status"] == active
    assert await count_runs(api.engine) == 1


async def test_an_answer_resumes_the_waiting_run(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    first = (await turn(client, session, {"input": "book", "priority": "async"})).json()
    lease = await claim(api)
    await api.queue.wait_for_user(lease, {"text": "Which day?"}, step=1, state={})
    waiting = (await client.get(f"/runs/{first['id']}")).json()
    assert (waiting["status"], waiting["question"]) == ("waiting_for_user", {"text": "Which day?"})
    assert (await client.get(f"/sessions/{session}")).json()["state"] == "waiting_for_user"

    # Fields the answer leaves out come from the waiting run; it is the same run, queued again.
    answer = await turn(client, session, {"input": "Tuesday"})
    assert answer.status_code == 202
    resumed = answer.json()
    assert (resumed["id"], resumed["status"], resumed["class"]) == (first["id"], "queued", "async")
    assert resumed["question"] is None
    assert await api.queue.inputs(UUID(first["id"])) == ["book", "Tuesday"]
    assert await count_runs(api.engine) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", "interactive"), ("scheduled_for", "2031-01-01T00:00:00+00:00")],
)
async def test_an_answer_cannot_change_the_waiting_run(api: Api, field: str, value: str) -> None:
    client = await api.client()
    session = await new_session(client)
    await turn(client, session, {"input": 1, "priority": "async"})
    await api.queue.wait_for_user(await claim(api), "?", step=1, state={})
    refused = assert_problem(
        await turn(client, session, {"input": 2, field: value}), 422, "answer-conflict"
    )
    assert refused["field"] == field
    # The run's own values are fine, and so is leaving them out.
    assert (await turn(client, session, {"input": 2, "priority": "async"})).status_code == 202


async def test_sessionless_runs_default_to_async(api: Api) -> None:
    client = await api.client()
    runs = [await client.post("/runs", json={"input": {"n": i}}) for i in range(3)]
    assert {r.status_code for r in runs} == {202}
    assert {r.json()["class"] for r in runs} == {"async"}
    assert {r.json()["session_id"] for r in runs} == {None}


async def test_maintenance_needs_the_operator_scope(api: Api) -> None:
    plain = await api.client()
    assert_problem(
        await plain.post("/runs", json={"input": 1, "priority": "maintenance"}), 403, "forbidden"
    )
    operator = await api.client("acme", "ops", "operator")
    response = await operator.post("/runs", json={"input": 1, "priority": "maintenance"})
    assert response.json()["class"] == "maintenance"


# --- idempotency -----------------------------------------------------------------------------
async def test_replay_and_reuse(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    first = await turn(client, session, {"input": {"a": 1, "b": 2}}, key="k-1")
    # Same request, keys in another order: the same canonical body, so a replay.
    again = await client.post(
        f"/sessions/{session}/turns",
        content=b'{"input": {"b": 2, "a": 1}}',
        headers={"Idempotency-Key": "k-1", "Content-Type": "application/json"},
    )
    assert again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert again.json() == first.json()
    assert again.headers["location"] == first.headers["location"]
    reused = await turn(client, session, {"input": {"a": 2}}, key="k-1")
    assert_problem(reused, 422, "idempotency-key-reused")
    # The same key on another path is another request too.
    assert_problem(
        await client.post(
            "/runs", json={"input": {"a": 1, "b": 2}}, headers={"Idempotency-Key": "k-1"}
        ),
        422,
        "idempotency-key-reused",
    )
    assert await count_runs(api.engine) == 1


async def test_keys_are_scoped_to_tenant_and_principal(api: Api) -> None:
    alice = await api.client("acme", "alice")
    bob = await api.client("acme", "bob")
    for client in (alice, bob):
        response = await client.post("/runs", json={"input": 1}, headers={"Idempotency-Key": "x"})
        assert response.status_code == 202
        assert "idempotent-replayed" not in response.headers
    assert await count_runs(api.engine) == 2


async def test_fifty_identical_submissions_make_one_run(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    responses = await asyncio.gather(
        *(turn(client, session, {"input": "same"}, key="burst") for _ in range(50))
    )
    assert {r.status_code for r in responses} == {202}, {r.text for r in responses}
    assert len({r.json()["id"] for r in responses}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 49
    assert await count_runs(api.engine) == 1


async def test_fifty_different_turns_to_one_session_make_one_run(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    responses = await asyncio.gather(
        *(turn(client, session, {"input": i}, key=f"k{i}") for i in range(50))
    )
    codes = sorted(r.status_code for r in responses)
    assert codes == [202] + [409] * 49
    winner = next(r.json()["id"] for r in responses if r.status_code == 202)
    assert {r.json()["active_run_id"] for r in responses if r.status_code == 409} == {winner}
    assert await count_runs(api.engine) == 1


async def test_a_twin_in_flight_waits_then_gets_409_with_retry_after(api: Api) -> None:
    secret = await api.key("acme", "carol")
    client = httpx.AsyncClient(base_url=api.base, headers={"Authorization": f"Bearer {secret}"})
    api.clients.append(client)
    async with api.engine.connect() as holder:
        # A twin's uncommitted key, as if its request were still being processed.
        await holder.execute(
            text(
                "INSERT INTO idempotency_keys (tenant_id, principal, key, request_hash, "
                "response_status, response_body, expires_at) VALUES ('acme', 'carol', 'slow', 'h', "
                "0, '{}', now() + interval '1 hour')"
            )
        )
        response = await client.post(
            "/runs", json={"input": 1}, headers={"Idempotency-Key": "slow"}
        )
        body = assert_problem(response, 409, "idempotency-key-in-flight")
        assert response.headers["retry-after"] == "1"
        assert "slow" in body["detail"]
        await holder.rollback()
    # The twin gave up (rolled back): the key is free, and the retry goes through.
    retry = await client.post("/runs", json={"input": 1}, headers={"Idempotency-Key": "slow"})
    assert retry.status_code == 202
    assert await count_runs(api.engine) == 1


async def test_an_expired_key_counts_as_absent(api: Api) -> None:
    client = await api.client("acme", "dave")
    first = await client.post("/runs", json={"input": 1}, headers={"Idempotency-Key": "old"})
    async with api.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' "
                "WHERE key = 'old'"
            )
        )
    second = await client.post("/runs", json={"input": 2}, headers={"Idempotency-Key": "old"})
    assert second.status_code == 202
    assert second.json()["id"] != first.json()["id"]


async def test_only_successful_outcomes_are_stored(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    first = (await turn(client, session, {"input": 1})).json()
    refused = await turn(client, session, {"input": 2}, key="after-busy")
    assert_problem(refused, 409, "session-busy")
    await api.queue.complete(await claim(api), {"ok": True})
    # The 409 was not remembered: the same request now starts a run.
    accepted = await turn(client, session, {"input": 2}, key="after-busy")
    assert accepted.status_code == 202
    assert accepted.json()["id"] != first["id"]
    assert "idempotent-replayed" not in accepted.headers


# --- tenancy ---------------------------------------------------------------------------------
async def test_another_tenant_sees_nothing(api: Api) -> None:
    mine = await api.client("acme", "alice")
    theirs = await api.client("globex", "mallory")
    session = await new_session(mine)
    run = (await turn(mine, session, {"input": 1})).json()["id"]
    for response in [
        await theirs.get(f"/sessions/{session}"),
        await theirs.get(f"/sessions/{session}/runs"),
        await theirs.post(f"/sessions/{session}/turns", json={"input": 2}),
        await theirs.get(f"/runs/{run}"),
        await theirs.get(f"/runs/{run}/events"),
        await theirs.post(f"/runs/{run}/cancel"),
    ]:
        assert_problem(response, 404, "not-found")
    assert (await mine.get(f"/runs/{run}")).json()["status"] == "queued"
    # An admin key sees any run, but changes only its own tenant's.
    admin = await api.client("platform", "sre", "admin")
    assert (await admin.get(f"/runs/{run}")).status_code == 200
    assert_problem(await admin.post(f"/runs/{run}/cancel"), 404, "not-found")
    assert (await mine.get(f"/runs/{run}")).json()["status"] == "queued"


async def test_an_operators_turn_in_a_users_session_stays_the_users_run(api: Api) -> None:
    """An operator may post a turn to any session of its tenant; the run is the session
    owner's (she can read and cancel it, and is not locked out of her own session)."""
    alice = await api.client("acme", "alice")
    ops = await api.client("acme", "ops", "operator")
    session = await new_session(alice)
    response = await turn(ops, session, {"input": "on alice's behalf"})
    assert response.status_code == 202
    run = response.json()["id"]
    assert (await alice.get(f"/runs/{run}")).status_code == 200
    found = await api.queue.get_run(UUID(run))
    assert found is not None
    assert found.principal == "alice"
    created = (await api.queue.events(UUID(run)))[0]
    assert created.data["by"].endswith("(acme/ops)")  # who posted it stays on record
    assert (await alice.post(f"/runs/{run}/cancel")).json()["status"] == "cancelled"
    assert (await turn(alice, session, {"input": "mine"})).status_code == 202


async def test_a_key_without_a_scope_sees_only_its_own_principal(api: Api) -> None:
    alice = await api.client("acme", "alice")
    carol = await api.client("acme", "carol")
    session = await new_session(alice)
    run = (await turn(alice, session, {"input": 1})).json()["id"]
    await api.queue.wait_for_user(await claim(api), "Which day?", step=1, state={})
    sse = {"Accept": "text/event-stream"}
    for request in [
        carol.get(f"/sessions/{session}"),
        carol.get(f"/sessions/{session}/runs"),
        carol.post(f"/sessions/{session}/turns", json={"input": "Monday"}),
        carol.get(f"/runs/{run}"),
        carol.get(f"/runs/{run}", params={"wait": 1, "status": "waiting_for_user"}),
        carol.get(f"/runs/{run}/events"),
        carol.get(f"/runs/{run}/events", headers=sse),  # a stream would never end: bounded
        carol.post(f"/runs/{run}/cancel"),
    ]:
        assert_problem(await asyncio.wait_for(request, 10), 404, "not-found")
    # Nothing carol sent reached alice's run: still waiting, with only alice's first input.
    assert (await alice.get(f"/runs/{run}")).json()["status"] == "waiting_for_user"
    assert await api.queue.inputs(UUID(run)) == [1]
    # Operators keep their tenant-wide view and actions; admins read any run.
    ops = await api.client("acme", "ops", "operator")
    assert (await ops.get(f"/sessions/{session}")).json()["state"] == "waiting_for_user"
    assert [r["id"] for r in (await ops.get(f"/sessions/{session}/runs")).json()["runs"]] == [run]
    assert (await ops.get(f"/runs/{run}/events")).status_code == 200
    admin = await api.client("platform", "sre", "admin")
    assert (await admin.get(f"/runs/{run}")).status_code == 200
    assert (await ops.post(f"/runs/{run}/cancel")).json()["status"] == "cancelled"
    # Alice's own key acts on her own session as before.
    assert (await turn(alice, session, {"input": 2})).status_code == 202


# --- reading runs ----------------------------------------------------------------------------
async def test_etag_and_not_modified(api: Api) -> None:
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()
    first = await client.get(f"/runs/{run['id']}")
    etag = first.headers["etag"]
    assert (
        await client.get(f"/runs/{run['id']}", headers={"If-None-Match": etag})
    ).status_code == 304
    await claim(api)
    changed = await client.get(f"/runs/{run['id']}", headers={"If-None-Match": etag})
    assert changed.status_code == 200
    assert changed.json()["status"] == "running"


async def test_long_poll_returns_when_the_status_changes(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's NOTIFY wakes the poll: rechecks are pushed out to an hour, so without
    the wake-up the poll would sit until its 60 s wait ran out and the test fail at 30 s."""
    monkeypatch.setattr(app.api.runs, "POLL_RECHECK_SECONDS", 3600.0)
    monkeypatch.setattr(app.api.watch, "IDLE_RECHECK_SECONDS", 3600.0)
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    lease = await claim(api)
    poll = asyncio.create_task(client.get(f"/runs/{run}", params={"wait": 60}))
    assert api.app is not None
    watch = api.app.state.turnstile.watch

    async def waiting() -> bool:
        return bool(watch._waiters)  # the poll read the run and now waits for a change

    await eventually(waiting, what="the long poll to wait")
    await api.queue.complete(lease, {"answer": 42})
    response = await asyncio.wait_for(poll, 30)
    assert response.json()["status"] == "succeeded"
    assert response.json()["result"] == {"answer": 42}
    # A finished run answers at once, whatever the wait.
    done = await asyncio.wait_for(client.get(f"/runs/{run}", params={"wait": 60}), 10)
    assert done.json()["status"] == "succeeded"


async def test_long_poll_from_a_known_status(api: Api) -> None:
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    await claim(api)
    # The client last saw "queued"; the run is already running: answer at once.
    response = await asyncio.wait_for(
        client.get(f"/runs/{run}", params={"wait": 30, "status": "queued"}), 10
    )
    assert response.json()["status"] == "running"


async def test_events_page_and_stream_resume(api: Api) -> None:
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    lease = await claim(api)
    await api.queue.append_event(lease, "agent.note", {"n": 1})
    page = (await client.get(f"/runs/{run}/events")).json()
    assert [e["type"] for e in page["events"]] == ["run.created", "run.claimed", "agent.note"]
    assert (page["last_seq"], page["finished"]) == (3, False)
    after = (await client.get(f"/runs/{run}/events", params={"after": 2})).json()
    assert [e["seq"] for e in after["events"]] == [3]

    received: list[tuple[str, str]] = []

    async def follow(last_event_id: str) -> None:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": last_event_id}
        async with client.stream("GET", f"/runs/{run}/events", headers=headers) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            event_id = ""
            async for line in stream.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("event: "):
                    received.append((event_id, line[7:]))
                    if line[7:] == "agent.note":
                        await api.queue.complete(lease, {})

    await asyncio.wait_for(follow("2"), 20)  # ends by itself after the terminal event
    assert received == [("3", "agent.note"), ("4", "run.succeeded")]
    body = (await client.get(f"/runs/{run}/events", params={"after": 3})).json()
    assert body["finished"] is True


async def test_session_runs_newest_first_with_cursor(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    ids = []
    for i in range(3):
        ids.append((await turn(client, session, {"input": i})).json()["id"])
        await api.queue.complete(await claim(api), {})
    first = (await client.get(f"/sessions/{session}/runs", params={"limit": 2})).json()
    assert [r["id"] for r in first["runs"]] == [ids[2], ids[1]]
    rest = (
        await client.get(
            f"/sessions/{session}/runs", params={"limit": 2, "cursor": first["next_cursor"]}
        )
    ).json()
    assert [r["id"] for r in rest["runs"]] == [ids[0]]
    assert rest["next_cursor"] is None


# --- cancel ----------------------------------------------------------------------------------
async def test_cancel_semantics(api: Api) -> None:
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    lease = await claim(api)
    cancelled = await client.post(f"/runs/{run}/cancel")
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    assert await api.queue.heartbeat(lease) is False
    again = await client.post(f"/runs/{run}/cancel")
    assert (again.status_code, again.json()["status"]) == (200, "cancelled")
    done = (await client.post("/runs", json={"input": 2})).json()["id"]
    await api.queue.complete(await claim(api), {})
    assert_problem(await client.post(f"/runs/{done}/cancel"), 409, "run-finished")
    events = (await client.get(f"/runs/{run}/events")).json()["events"]
    assert events[-1]["type"] == "run.cancelled"
    assert events[-1]["data"]["by"].startswith("key:")


# --- the runbook ------------------------------------------------------------------------------
async def test_queue_stats_per_tenant_and_for_admins(api: Api) -> None:
    acme = await api.client("acme", "alice")
    globex = await api.client("globex", "bob")
    for _ in range(2):
        await acme.post("/runs", json={"input": 1})
    await globex.post("/runs", json={"input": 1, "priority": "interactive"})
    ops = await api.client("acme", "ops", "operator")
    stats = (await ops.get("/queue/stats")).json()
    assert stats["scope"] == "tenant:acme"
    assert stats["classes"]["async"]["queued"] == 2
    assert stats["classes"]["interactive"]["queued"] == 0
    assert stats["classes"]["async"]["oldest_eligible_age_seconds"] >= 0
    admin = await api.client("platform", "sre", "admin")
    everything = (await admin.get("/queue/stats")).json()
    assert everything["scope"] == "all"
    assert everything["classes"]["interactive"]["queued"] == 1


async def test_dead_letter_resubmit_and_dismiss(api: Api) -> None:
    client = await api.client()
    ops = await api.client("acme", "ops", "operator")
    run = (await client.post("/runs", json={"input": {"job": 7}})).json()["id"]
    await api.queue.fail(await claim(api), {"kind": "permanent", "message": "bad input"})
    failed = (await ops.get("/runs/failed")).json()["runs"]
    assert [(r["id"], r["failure"]["kind"]) for r in failed] == [(run, "permanent")]

    again = await ops.post(f"/runs/{run}/resubmit")
    assert again.status_code == 202
    new = again.json()
    assert (new["input"], new["resubmitted_from"], new["status"]) == ({"job": 7}, run, "queued")
    assert (await client.get(f"/runs/{run}")).json()["status"] == "failed"
    # One new run per failed run: resubmitting again answers with the same one, replayed.
    twice = await ops.post(f"/runs/{run}/resubmit")
    assert (twice.status_code, twice.json()["id"]) == (202, new["id"])
    assert twice.headers["Idempotent-Replayed"] == "true"
    # Idempotency-Key is honoured: a replay, and a reuse on another run is refused.
    keyed = await ops.post(f"/runs/{run}/resubmit", headers={"Idempotency-Key": "rs-1"})
    assert keyed.json()["id"] == new["id"]
    replay = await ops.post(f"/runs/{run}/resubmit", headers={"Idempotency-Key": "rs-1"})
    assert (replay.json()["id"], replay.headers["Idempotent-Replayed"]) == (new["id"], "true")
    reused = await ops.post(f"/runs/{new['id']}/resubmit", headers={"Idempotency-Key": "rs-1"})
    assert_problem(reused, 422, "idempotency-key-reused")

    dismissed = await ops.post(f"/runs/{run}/dismiss")
    assert dismissed.json()["dismissed_at"] is not None
    assert (await ops.post(f"/runs/{run}/dismiss")).status_code == 200  # idempotent
    assert (await ops.get("/runs/failed")).json()["runs"] == []
    types = [e["type"] for e in (await client.get(f"/runs/{run}/events")).json()["events"]]
    assert types[-2:] == ["operator.resubmitted", "operator.dismissed"]
    assert_problem(await ops.post(f"/runs/{new['id']}/dismiss"), 409, "run-not-failed")
    # Another tenant's operator cannot touch it.
    other = await api.client("globex", "ops", "operator")
    assert_problem(await other.post(f"/runs/{run}/resubmit"), 404, "not-found")


async def test_stuck_runs(database_url: str, engine: AsyncEngine) -> None:
    """The app and the test share a clock they move: the lease expires because time is moved
    past it, not because the wall clock ran (no 1 ms lease, no waiting)."""
    clock = ManualClock()
    async with running_api(database_url, engine, clock=clock) as api:
        client = await api.client()
        ops = await api.client("acme", "ops", "operator")
        run = (await client.post("/runs", json={"input": 1})).json()["id"]
        await api.queue.claim("w", list(PriorityClass), lease_seconds=30)
        assert (await ops.get("/runs/stuck")).json()["runs"] == []
        clock.advance(31)
        stuck = (await ops.get("/runs/stuck")).json()["runs"]
        assert [(s["reason"], s["run"]["id"]) for s in stuck] == [("lease_expired", run)]
        queued = (await client.post("/runs", json={"input": 2})).json()["id"]
        clock.advance(1)
        both = (await ops.get("/runs/stuck", params={"queued_seconds": 0})).json()["runs"]
        assert {(s["reason"], s["run"]["id"]) for s in both} == {
            ("lease_expired", run),
            ("queued_too_long", queued),
        }


async def test_readiness_reports_workers(database_url: str, engine: AsyncEngine) -> None:
    async with (
        running_api(database_url, engine, workers=True) as running,
        httpx.AsyncClient(base_url=running.base) as client,
    ):
        ready = (await client.get("/readyz")).json()
    assert ready["status"] == "ready"
    assert ready["checks"]["workers"] == "up"


async def test_an_open_stream_ends_when_the_service_stops(
    database_url: str, engine: AsyncEngine
) -> None:
    ended = asyncio.Event()
    client = httpx.AsyncClient(timeout=30)  # outlives the server, unlike the Api's clients
    async with running_api(database_url, engine) as running:
        client.base_url = httpx.URL(running.base)
        client.headers["Authorization"] = f"Bearer {await running.key()}"
        run = (await client.post("/runs", json={"input": 1})).json()["id"]  # stays queued
        opened = asyncio.Event()

        async def follow() -> None:
            headers = {"Accept": "text/event-stream"}
            async with client.stream("GET", f"/runs/{run}/events", headers=headers) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("event: run.created"):
                        opened.set()
            ended.set()

        follower = asyncio.create_task(follow())
        await asyncio.wait_for(opened.wait(), 10)
    # Leaving the block stops the server the way a SIGTERM does; the stream must not hold it.
    try:
        await asyncio.wait_for(follower, 10)
    finally:
        await client.aclose()
    assert ended.is_set()


async def test_a_lock_timeout_is_a_503_with_retry_after(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, lock_timeout_ms=200) as running:
        client = await running.client()
        session = await new_session(client)
        async with engine.connect() as holder:
            await holder.execute(
                text("SELECT 1 FROM sessions WHERE id = :id FOR UPDATE"), {"id": session}
            )
            response = await turn(client, session, {"input": 1})
            assert_problem(response, 503, "database-busy")
            assert response.headers["retry-after"] == "1"
            await holder.rollback()
        assert (await turn(client, session, {"input": 1})).status_code == 202


# --- the cost and the cap of streams and long polls --------------------------------------------
class StatementCounter:
    """Counts the statements the service under test sends to PostgreSQL (its own engine)."""

    def __init__(self, api: Api) -> None:
        assert api.app is not None
        self.engine: AsyncEngine = api.app.state.turnstile.engine
        self.count = 0
        event.listen(self.engine.sync_engine, "before_cursor_execute", self._seen)

    def _seen(self, *_: object) -> None:
        self.count += 1

    def close(self) -> None:
        event.remove(self.engine.sync_engine, "before_cursor_execute", self._seen)


async def waiting_run(api: Api, client: httpx.AsyncClient) -> str:
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    await api.queue.wait_for_user(await claim(api), "Which day?", step=1, state={})
    return str(run)


async def test_idle_streams_cost_the_database_almost_nothing(api: Api) -> None:
    client = await api.client()
    runs = [await waiting_run(api, client) for _ in range(40)]
    opened: list[asyncio.Event] = [asyncio.Event() for _ in runs]

    async def follow(run: str, seen: asyncio.Event) -> list[str]:
        types: list[str] = []
        headers = {"Accept": "text/event-stream"}
        async with client.stream("GET", f"/runs/{run}/events", headers=headers) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    types.append(line[7:])
                    if line == "event: run.waiting":
                        seen.set()
        return types

    followers = [asyncio.create_task(follow(r, s)) for r, s in zip(runs, opened, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in opened)), 20)
    counter = StatementCounter(api)
    try:
        # A measurement window, not synchronisation: 40 idle streams used to recheck twice
        # every 0.5 s (about 480 statements in 3 s); now they wait on notifications.
        await asyncio.sleep(3)
        idle_statements = counter.count
    finally:
        counter.close()
    assert idle_statements < 10, idle_statements
    # A notified change (here a cancel) still reaches an idle stream at once.
    await client.post(f"/runs/{runs[0]}/cancel")
    types = await asyncio.wait_for(followers[0], 10)
    assert types[-1] == "run.cancelled"
    for follower in followers[1:]:
        follower.cancel()
    await asyncio.gather(*followers[1:], return_exceptions=True)


async def test_a_long_poll_on_a_queued_run_sees_its_claim_promptly(api: Api) -> None:
    # Claims are not notified; a queued run that is due is rechecked every second.
    client = await api.client()
    run = (await client.post("/runs", json={"input": 1})).json()["id"]
    poll = asyncio.create_task(client.get(f"/runs/{run}", params={"wait": 30, "status": "queued"}))
    await eventually(lambda: api_streams_open(api), what="the long poll to be waiting")
    await claim(api)
    response = await asyncio.wait_for(poll, 5)
    assert response.json()["status"] == "running"


async def api_streams_open(api: Api) -> bool:
    assert api.app is not None
    return bool(api.app.state.turnstile.streams.open > 0)


async def test_streams_and_long_polls_are_capped_per_key_and_per_process(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url,
        engine,
        max_streams_per_key=2,
        max_streams_per_tenant=3,  # alice and bob are one tenant (tests/api/test_open_streams.py)
        max_streams_per_process=3,
    ) as api:
        alice = await api.client("acme", "alice")
        bob = await api.client("acme", "bob")
        alices = await waiting_run(api, alice)
        bobs = await waiting_run(api, bob)
        sse = {"Accept": "text/event-stream"}
        async with contextlib.AsyncExitStack() as streams:
            for _ in range(2):
                opened = await streams.enter_async_context(
                    alice.stream("GET", f"/runs/{alices}/events", headers=sse)
                )
                assert opened.status_code == 200
            # Alice's key is at its cap: a third stream or a long poll is refused...
            for request in [
                alice.get(f"/runs/{alices}/events", headers=sse),  # would never end: bounded
                alice.get(f"/runs/{alices}", params={"wait": 5}),
            ]:
                refused = await asyncio.wait_for(request, 10)
                body = assert_problem(refused, 429, "too-many-streams")
                assert int(refused.headers["retry-after"]) >= 1
                assert "per key" in body["detail"]
            # ...while plain reads are not streams and go through.
            assert (await alice.get(f"/runs/{alices}")).status_code == 200
            assert (await alice.get(f"/runs/{alices}/events")).status_code == 200
            # Bob takes the process's last place; after that the process is full for everyone.
            bobs_stream = await streams.enter_async_context(
                bob.stream("GET", f"/runs/{bobs}/events", headers=sse)
            )
            assert bobs_stream.status_code == 200
            full = assert_problem(
                await bob.get(f"/runs/{bobs}", params={"wait": 5}), 429, "too-many-streams"
            )
            assert "process" in full["detail"]
        # Closed streams give their places back.

        async def poll_accepted() -> bool:
            response = await alice.get(
                f"/runs/{alices}", params={"wait": 0.01, "status": "waiting_for_user"}
            )
            return response.status_code == 200

        await eventually(poll_accepted, what="the closed streams' places to be free")
        assert api.app is not None
        await eventually(
            lambda: _no_open_streams(api), what="every stream and long poll to be closed"
        )


async def _no_open_streams(api: Api) -> bool:
    assert api.app is not None
    return bool(api.app.state.turnstile.streams.open == 0)
