"""Multitask policies against a real `turnstile worker` process (issue 33 item 1;
docs/turn-control.md).

The matrix: each policy (reject, enqueue, interrupt, steer) meets a run in each state a busy
session's run can be in: queued (behind a backlog that holds the worker's one interactive
slot), running a tool (an HTTP call the test holds open), and waiting for the user. Reject
answers 409 while the run is queued or running; enqueue starts the turn when the run ends,
and the new run sees its transcript; interrupt ends a queued run at once and a running one at
its next boundary (the call in flight waited for); steer reaches the run, queued or running,
at its next boundary; and a run waiting for the user takes any turn as its answer.

Beside it: start deadlines under a backlog, one met and one missed (its expiry an end that
starts the turn enqueued behind it); a steer that arrives after the run's last boundary
becomes the session's next run; an interrupt of a run with an unsafe call in flight either
waits for the call (its outcome kept) or, past its bound, cancels the run with the call
`uncertain` and the worker's late outcome fenced, the effect made once; and a worker
SIGKILLed with an interrupt pending does not hold it up past its bound, whether it was
running a safe or an unsafe call."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.records import Run
from tests.support.api import Api, running_api
from tests.support.invariants import check_all_runs
from tests.support.processes import Child, turnstile
from tests.support.servers import running_server
from tests.support.waiting import eventually


@dataclass
class Effects:
    """A loopback service whose every request is an effect, counted by path. A request to
    /hold/NAME is answered only once `release(NAME)` is called: a tool call the test keeps in
    flight for as long as it needs the run to be running it."""

    hits: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def release(self, name: str) -> None:
        self.gate(name).set()

    def count(self, path: str) -> int:
        return sum(1 for _, hit in self.hits if hit == path)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def record(path: str, request: Request) -> JSONResponse:
            self.hits.append((request.method, "/" + path))
            if path.startswith("hold/"):
                await self.gate(path.removeprefix("hold/")).wait()
            return JSONResponse({"ok": True, "path": "/" + path})

        return app


@dataclass
class Service:
    api: Api
    client: httpx.AsyncClient
    effects: Effects
    base: str  # the effects service's URL
    database_url: str

    def worker(self) -> AbstractAsyncContextManager[Child]:
        return turnstile(
            "worker",
            ready=b"running slots",
            env={
                "DATABASE_URL": self.database_url,
                # Polling explains nothing here: every claim follows a notification or the
                # end of an execution in the same process.
                "TURNSTILE_POLL_INTERVAL_SECONDS": "60",
                "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
                # One interactive slot: a sessionless interactive run holding it is a backlog
                # that keeps a session's run queued for as long as the test needs.
                "TURNSTILE_SLOTS": "interactive:1,async:1,maintenance:1",
                "TURNSTILE_HTTP_ALLOWED_HOSTS": self.base.removeprefix("http://"),
                # A held call lasts as long as the test holds it, not the tool's timeout.
                "TURNSTILE_HTTP_TIMEOUT_SECONDS": "300",
                # The interrupt's bound is enforced by the sweep of this process.
                "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
            },
        )

    def held(self, name: str, method: str = "GET") -> dict[str, Any]:
        """A script step: an HTTP call answered once the test releases `name` (GET is safe,
        POST unsafe: docs/runtime.md)."""
        return {
            "call": "http_request",
            "args": {"method": method, "url": f"{self.base}/hold/{name}"},
        }

    async def session(self, policy: str) -> str:
        response = await self.client.post("/sessions", json={"multitask": policy})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    async def turn(self, session: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(f"/sessions/{session}/turns", json=body)
        assert response.status_code == 202, response.text
        result: dict[str, Any] = response.json()
        return result

    async def run(self, run_id: str | UUID) -> Run:
        run = await self.api.queue.get_run(UUID(str(run_id)))
        assert run is not None
        return run

    async def ended(self, run_id: str | UUID) -> Run | None:
        run = await self.run(run_id)
        return run if run.status in ("succeeded", "failed", "cancelled") else None

    async def in_status(self, run_id: str | UUID, status: str) -> Run | None:
        run = await self.run(run_id)
        return run if run.status == status else None

    async def events(self, run_id: str | UUID) -> list[Any]:
        return list(await self.api.queue.events(UUID(str(run_id))))

    async def pending(self, session: str, turn_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = (
            await self.client.get(f"/sessions/{session}/pending-turns/{turn_id}")
        ).json()
        return doc

    async def pending_list(self, session: str) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = (
            await self.client.get(f"/sessions/{session}/pending-turns")
        ).json()["pending_turns"]
        return listed

    async def hit(self, path: str) -> bool:
        return self.effects.count(path) > 0

    async def session_runs(self, session: str) -> list[tuple[int, str]]:
        """(run number, status) of every run of the session, in order."""
        async with self.api.engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT session_run_no, status FROM runs WHERE session_id = :s "
                    "ORDER BY session_run_no"
                ),
                {"s": session},
            )
            return [(int(no), str(status)) for no, status in rows]


async def make_service(
    database_url: str, engine: AsyncEngine, grace: float
) -> AsyncIterator[Service]:
    effects = Effects()
    async with (
        running_server(effects.app()) as base,
        running_api(database_url, engine, interrupt_grace_seconds=grace) as api,
    ):
        try:
            yield Service(api, await api.client(), effects, base, database_url)
        finally:
            for gate in effects.gates.values():
                gate.set()  # nothing the worker holds outlives the test


# The interrupt's bound of the API under test: long by default (a run that stops, stopped at a
# boundary, not by the sweep); a test that needs the sweep to end a run asks for a short one.
LONG_BOUND, SHORT_BOUND = 120.0, 1.0


@pytest.fixture
async def service(
    request: pytest.FixtureRequest, database_url: str, engine: AsyncEngine
) -> AsyncIterator[Service]:
    grace = float(getattr(request, "param", LONG_BOUND))
    async for running in make_service(database_url, engine, grace=grace):
        yield running


# --- the matrix ---------------------------------------------------------------------------
async def busy_run(svc: Service, session: str, state: str) -> tuple[str, Callable[[], None]]:
    """The session's first run, brought to `state` with the worker running; and what lets it
    go on (the backlog or the call released)."""
    if state == "queued":
        blocker = await svc.client.post(
            "/runs",
            json={"input": {"script": [svc.held("backlog")]}, "priority": "interactive"},
        )
        assert blocker.status_code == 202, blocker.text
        await eventually(lambda: svc.hit("/hold/backlog"), within=30, what="the backlog's call")
        first = await svc.turn(session, {"input": {"script": [{"call": "echo"}, {"final": 1}]}})
        assert first["status"] == "queued"
        return first["id"], lambda: svc.effects.release("backlog")
    if state == "tool":
        first = await svc.turn(session, {"input": {"script": [svc.held("first"), {"final": 1}]}})
        await eventually(lambda: svc.hit("/hold/first"), within=30, what="the run's call")
        return first["id"], lambda: svc.effects.release("first")
    first = await svc.turn(session, {"input": {"script": [{"ask": "which?"}, {"final": 1}]}})
    await eventually(
        lambda: svc.in_status(first["id"], "waiting_for_user"), within=30, what="the question"
    )
    return first["id"], lambda: None


# What the second turn does, by policy and by the state of the run it meets.
MATRIX = {
    **{(policy, "waiting"): "answer" for policy in ("reject", "enqueue", "interrupt", "steer")},
    ("reject", "queued"): "refused",
    ("reject", "tool"): "refused",
    ("enqueue", "queued"): "next run",
    ("enqueue", "tool"): "next run",
    ("interrupt", "queued"): "replaces it at once",
    ("interrupt", "tool"): "replaces it at its boundary",
    ("steer", "queued"): "steers it",
    ("steer", "tool"): "steers it",
}


@pytest.mark.parametrize(("policy", "state"), sorted(MATRIX))
async def test_each_policy_meets_a_run_in_each_state(
    service: Service, policy: str, state: str
) -> None:
    svc = service
    expected = MATRIX[(policy, state)]
    session = await svc.session(policy)
    second_input = {"text": "second", "echo_history": True}
    async with svc.worker():
        first, let_go = await busy_run(svc, session, state)
        response = await svc.client.post(f"/sessions/{session}/turns", json={"input": second_input})
        body = response.json()

        if expected == "refused":
            assert response.status_code == 409, response.text
            assert (body["type"], body["active_run_id"]) == ("/problems/session-busy", first)
            assert await svc.pending_list(session) == []  # nothing written
            let_go()
            done = await eventually(lambda: svc.ended(first), within=30, what="the run")
            assert done.status == "succeeded"
            assert await svc.session_runs(session) == [(1, "succeeded")]

        elif expected == "answer":
            assert response.status_code == 202, response.text
            assert (body["id"], body["status"]) == (first, "queued")
            done = await eventually(lambda: svc.ended(first), within=30, what="the answered run")
            assert done.status == "succeeded"
            assert isinstance(done.result, dict)
            assert done.result["answers"] == [second_input]
            assert await svc.pending_list(session) == []
            assert await svc.session_runs(session) == [(1, "succeeded")]

        elif expected == "next run":
            assert response.status_code == 202, response.text
            assert (body["kind"], body["status"], body["position"]) == (
                "pending_turn",
                "pending",
                1,
            )
            assert "turn.pending" in [e.type for e in await svc.events(first)]
            let_go()
            done = await eventually(lambda: svc.ended(first), within=30, what="the first run")
            assert done.status == "succeeded"
            assert isinstance(done.result, dict)
            assert "steered" not in done.result
            started = await svc.pending(session, body["id"])
            assert (started["status"], started["run_id"]) == ("started", body["id"])
            second = await eventually(lambda: svc.ended(body["id"]), within=30, what="run 2")
            assert second.status == "succeeded"
            assert isinstance(second.result, dict)
            # It saw the whole transcript of the run before it, which had ended.
            history = second.result["history"]
            assert [(h["run_no"], h["role"], h["kind"]) for h in history][-1] == (
                1,
                "assistant",
                "final",
            )
            assert await svc.session_runs(session) == [(1, "succeeded"), (2, "succeeded")]

        elif expected == "replaces it at once":
            # A queued run has no boundary to wait for: cancelled in the submission itself,
            # never claimed, and the answer is the run the turn became.
            assert response.status_code == 202, response.text
            assert (body["status"], body["session_run_no"]) == ("queued", 2)
            old = await svc.run(first)
            assert (old.status, old.attempts, old.started_at) == ("cancelled", 0, None)
            events = await svc.events(first)
            assert [e.type for e in events][-3:] == [
                "turn.pending",
                "run.interrupted",
                "run.cancelled",
            ]
            assert events[-2].data["by"] == "submission"
            assert events[-1].data["reason"] == "interrupted"
            let_go()
            second = await eventually(lambda: svc.ended(body["id"]), within=30, what="run 2")
            assert second.status == "succeeded"
            assert await svc.session_runs(session) == [(1, "cancelled"), (2, "succeeded")]

        elif expected == "replaces it at its boundary":
            assert response.status_code == 202, response.text
            assert (body["kind"], body["policy"]) == ("pending_turn", "interrupt")
            assert body["interrupt_by"] is not None
            # The call in flight is waited for: the run stops at the boundary after it.
            let_go()
            stopped = await eventually(lambda: svc.ended(first), within=30, what="the stop")
            assert stopped.status == "cancelled"
            events = await svc.events(first)
            types = [e.type for e in events]
            assert events[types.index("run.interrupted")].data["by"] == "worker"
            assert events[-1].data["reason"] == "interrupted"
            # Every call it started has its own outcome, none settled by the cancel.
            finished = [e for e in events if e.type == "tool.finished"]
            assert types.count("tool.started") == len(finished) == 1
            assert finished[0].data["outcome_status"] == "succeeded"
            assert "by" not in finished[0].data
            assert "run.succeeded" not in types
            second = await eventually(lambda: svc.ended(body["id"]), within=30, what="run 2")
            assert second.status == "succeeded"
            assert await svc.session_runs(session) == [(1, "cancelled"), (2, "succeeded")]

        else:  # steers it
            assert response.status_code == 202, response.text
            assert body["id"] == first  # the answer is the active run itself
            turn = body["pending_turn"]
            assert (turn["policy"], turn["status"]) == ("steer", "pending")
            let_go()
            done = await eventually(lambda: svc.ended(first), within=30, what="the steered run")
            assert done.status == "succeeded"
            assert isinstance(done.result, dict)
            assert done.result["steered"] == [second_input]
            delivered = await svc.pending(session, turn["id"])
            assert (delivered["status"], delivered["run_id"]) == ("delivered", first)
            events = await svc.events(first)
            taken = [e for e in events if e.type == "run.input_delivered"]
            assert [e.data["policy"] for e in taken] == ["steer"]
            assert await svc.session_runs(session) == [(1, "succeeded")]

    # Every run's log is valid, the backlog's run included; nothing is left pending.
    runs = len(await svc.session_runs(session)) + (state == "queued")
    assert await check_all_runs(svc.api.engine) == runs
    assert await svc.pending_list(session) == []


# --- a steer as the run ends --------------------------------------------------------------
async def test_a_steer_that_arrives_after_the_last_boundary_becomes_the_next_run(
    service: Service,
) -> None:
    svc = service
    session = await svc.session("steer")
    # The scripted agent speaks its two steps within one decision: after the first
    # `message.completed`, the run has passed its last boundary and finishes without another.
    script = [{"say": "thinking"}, {"say": "a long answer", "pieces": 4, "delay": 0.5}]
    async with svc.worker() as worker:
        first = await svc.turn(session, {"input": {"script": script}})

        async def speaking() -> bool:
            return "message.completed" in [e.type for e in await svc.events(first["id"])]

        await eventually(speaking, within=30, what="the run's first message")
        # Frozen, the worker cannot end the run while the steer is accepted: the steer meets
        # a running run that will reach no boundary again.
        worker.process.send_signal(signal.SIGSTOP)
        try:
            assert (await svc.run(first["id"])).status == "running"
            steered = await svc.turn(session, {"input": {"text": "too late"}})
        finally:
            worker.process.send_signal(signal.SIGCONT)
        assert steered["id"] == first["id"]
        turn = steered["pending_turn"]
        assert turn["status"] == "pending"
        done = await eventually(lambda: svc.ended(first["id"]), within=30, what="the run")
        assert done.status == "succeeded"
        assert isinstance(done.result, dict)
        assert "steered" not in done.result
        # Not lost: it became the session's next run, under its own id.
        follow = await svc.pending(session, turn["id"])
        assert (follow["status"], follow["run_id"]) == ("started", turn["id"])
        second = await eventually(lambda: svc.ended(turn["id"]), within=30, what="the next run")
    assert second.status == "succeeded"
    assert isinstance(second.result, dict)
    assert second.result["final"] == {"text": "too late"}
    assert "run.input_delivered" not in [e.type for e in await svc.events(first["id"])]
    assert await svc.session_runs(session) == [(1, "succeeded"), (2, "succeeded")]
    assert await check_all_runs(svc.api.engine) == 2


# --- an interrupt with an unsafe call in flight -------------------------------------------
@pytest.mark.parametrize(
    ("service", "bound"),
    [(LONG_BOUND, "waited for"), (SHORT_BOUND, "passed")],
    indirect=["service"],
)
async def test_an_interrupt_of_a_run_with_an_unsafe_call_in_flight(
    service: Service, bound: str
) -> None:
    svc = service
    session = await svc.session("interrupt")
    async with svc.worker():
        script = [svc.held("pay", "POST"), {"call": "echo"}, {"final": "never"}]
        first = (await svc.turn(session, {"input": {"script": script}}))["id"]
        await eventually(lambda: svc.hit("/hold/pay"), within=30, what="the unsafe call")
        pending = await svc.turn(session, {"input": {"text": "instead", "echo_history": True}})
        if bound == "waited for":
            # Within the bound the call ends: its outcome is kept, and the run stops at the
            # boundary after it, before its next call.
            svc.effects.release("pay")
        stopped = await eventually(lambda: svc.ended(first), within=60, what="the interrupt")
        assert stopped.status == "cancelled"
        events = await svc.events(first)
        [interrupted] = [e for e in events if e.type == "run.interrupted"]
        [finished] = [e for e in events if e.type == "tool.finished"]
        if bound == "waited for":
            assert interrupted.data["by"] == "worker"
            assert finished.data["outcome_status"] == "succeeded"
        else:
            # Past the bound, the sweep cancels the run; the call it left open may have taken
            # effect: uncertain, never made again. Then the worker's late answer arrives, and
            # its write is fenced (the cancel moved the epoch).
            assert interrupted.data["by"] == "deadline"
            assert finished.data["outcome_status"] == "uncertain"
            svc.effects.release("pay")
        # Run 2 needs the one interactive slot: once it has run, the worker's execution of
        # the interrupted run is over, whatever its late answer tried to write.
        after = await eventually(lambda: svc.ended(pending["id"]), within=30, what="run 2")
        assert after.status == "succeeded"
    assert svc.effects.count("/hold/pay") == 1  # the unsafe effect, made once
    # Still one outcome for the call, and nothing written after the cancel but a fence.
    events = await svc.events(first)
    assert [e.data["outcome_status"] for e in events if e.type == "tool.finished"] == [
        finished.data["outcome_status"]
    ]
    assert "tool.started" not in [e.type for e in events[events.index(interrupted) :]]
    assert isinstance(after.result, dict)
    calls = [h for h in after.result["history"] if h["kind"] == "tool_call"]
    assert len(calls) == 1  # the next run sees the call, with its outcome as recorded
    assert await check_all_runs(svc.api.engine) == 2


# --- a worker SIGKILLed with an interrupt pending -----------------------------------------
@pytest.mark.parametrize("service", [SHORT_BOUND], indirect=True)
@pytest.mark.parametrize(("klass", "settled"), [("safe", "abandoned"), ("unsafe", "uncertain")])
async def test_a_worker_killed_with_an_interrupt_pending_does_not_hold_it_up(
    service: Service, klass: str, settled: str
) -> None:
    svc = service
    session = await svc.session("interrupt")
    call = svc.held("call", "GET" if klass == "safe" else "POST")
    async with svc.worker() as worker:
        first = (await svc.turn(session, {"input": {"script": [call, {"final": "never"}]}}))["id"]
        await eventually(lambda: svc.hit("/hold/call"), within=30, what="the call")
        pending = await svc.turn(session, {"input": "instead"})
        worker.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(worker.process.wait(), 30)

    # Past the bound the sweep ends the run, whatever its lease says (the worker is dead and
    # its lease, 30 s, is far from lapsing).
    async def swept() -> bool:
        return await svc.api.queue.sweep_turns() == 1

    await eventually(swept, within=30, what="the interrupt's bound")
    run = await svc.run(first)
    assert run.status == "cancelled"
    events = await svc.events(run.id)
    assert [e.data["by"] for e in events if e.type == "run.interrupted"] == ["deadline"]
    # The call it left open is settled by its class, with its event.
    settled_events = [e for e in events if e.type == "tool.finished"]
    assert [e.data["outcome_status"] for e in settled_events] == [settled]
    doc = await svc.pending(session, pending["id"])
    assert (doc["status"], doc["run_id"]) == ("started", pending["id"])
    assert (await svc.run(doc["run_id"])).status == "queued"
    assert svc.effects.count("/hold/call") == 1
    assert await check_all_runs(svc.api.engine) == 2


# --- start deadlines under a backlog ------------------------------------------------------
async def test_deadlines_under_a_backlog_met_and_missed_with_pending_turns(
    service: Service,
) -> None:
    svc = service
    # The backlog: the worker's one interactive slot held by a sessionless run.
    blocker = await svc.client.post(
        "/runs", json={"input": {"script": [svc.held("backlog")]}, "priority": "interactive"}
    )
    assert blocker.status_code == 202, blocker.text
    async with svc.worker():
        await eventually(lambda: svc.hit("/hold/backlog"), within=30, what="the backlog's call")
        # Missed: a turn that cannot start in time behind the backlog, with a turn enqueued
        # behind it. Its expiry is an end: the enqueued turn starts in the expiry's statement.
        missed = await svc.session("enqueue")
        late = await svc.turn(missed, {"input": {"script": [{"final": 1}]}, "start_within": 1})
        queued_behind = await svc.turn(missed, {"input": {"text": "after", "echo_history": True}})
        assert queued_behind["kind"] == "pending_turn"
        # Met: a turn with room to wait, queued behind the same backlog.
        met = await svc.session("enqueue")
        patient = await svc.turn(met, {"input": {"script": [{"final": 2}]}, "start_within": 300})

        expired = await eventually(
            lambda: svc.in_status(late["id"], "cancelled"), within=30, what="the expiry"
        )
        assert (expired.attempts, expired.started_at) == (0, None)
        events = await svc.events(late["id"])
        assert [e.type for e in events] == ["run.created", "turn.pending", "run.cancelled"]
        assert events[-1].data == {"by": "expirer", "reason": "expired"}
        started = await svc.pending(missed, queued_behind["id"])
        assert (started["status"], started["run_id"]) == ("started", queued_behind["id"])
        assert (await svc.run(queued_behind["id"])).status == "queued"  # the backlog holds

        svc.effects.release("backlog")
        ran = await eventually(lambda: svc.ended(patient["id"]), within=30, what="the met run")
        after = await eventually(
            lambda: svc.ended(queued_behind["id"]), within=30, what="the turn behind it"
        )
    assert ran.status == "succeeded"
    # Started in time: the claim never starts an overdue run.
    assert ran.start_before is not None
    assert ran.started_at is not None
    assert ran.started_at < ran.start_before
    assert after.status == "succeeded"
    assert after.start_before is None  # a pending turn carries no deadline (docs)
    assert isinstance(after.result, dict)
    # The run it became saw the expired run before it, ended as expired.
    assert [(h["run_no"], h["kind"]) for h in after.result["history"]] == [
        (1, "input"),
        (1, "cancelled"),
    ]
    assert after.result["history"][-1]["content"]["reason"] == "expired"
    assert await svc.session_runs(missed) == [(1, "cancelled"), (2, "succeeded")]
    assert await svc.session_runs(met) == [(1, "succeeded")]
    assert await check_all_runs(svc.api.engine) == 4
