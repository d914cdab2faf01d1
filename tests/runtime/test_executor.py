"""The runtime against a real PostgreSQL and a real HTTP server on loopback that counts what
reaches it: crash injection at every tool-call boundary for each idempotency class, fencing,
transient and permanent failures, time limits, the allow-list, and asking the user through the
real API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.queue.core import Queue
from app.runtime.executor import (
    RuntimeExecutor,
    RuntimeLimits,
    SimulatedCrash,
    default_registry,
)
from app.runtime.http_tool import HttpRequestTool
from app.runtime.tools import PermanentToolError, ToolContext
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import running_api
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.runtime import current, execute_once, recover
from tests.support.servers import running_server
from tests.support.waiting import eventually


@dataclass
class Counter:
    """What the loopback server saw, and how it should answer."""

    hits: list[tuple[str, str, str | None]] = field(default_factory=list)
    fail_first: int = 0  # answer 503 to this many requests first
    on_hit: Callable[[], Any] | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def record(path: str, request: Request) -> JSONResponse:
            self.hits.append((request.method, "/" + path, request.headers.get("idempotency-key")))
            if self.on_hit is not None:
                await self.on_hit()
            if self.fail_first > 0:
                self.fail_first -= 1
                return JSONResponse({"error": "busy"}, status_code=503)
            return JSONResponse({"ok": True, "n": len(self.hits)})

        return app


@pytest.fixture
async def counter() -> AsyncIterator[tuple[Counter, str]]:
    seen = Counter()
    async with running_server(seen.app()) as base:
        yield seen, base


def runtime(crash: Callable[[str, int], None] | None = None, **limits: Any) -> RuntimeExecutor:
    return RuntimeExecutor(
        default_registry(["127.0.0.1"], http_timeout_seconds=5),
        RuntimeLimits(retry_backoff_seconds=0.01, **limits),
        crash_hook=crash,
    )


def scripted(*steps: dict[str, Any]) -> NewRun:
    return NewRun(
        tenant_id="t",
        principal="p",
        agent="scripted",
        input={"script": list(steps)},
        priority=PriorityClass.INTERACTIVE.base,
    )


CALLS = {
    "safe": {"method": "GET"},
    "keyed": {"method": "POST", "idempotency_key": True},
    "unsafe": {"method": "POST"},
}
# Server hits after recovery, and the outcome the run records, per boundary and class.
EXPECTED = {
    ("before_started", "safe"): (1, "succeeded"),
    ("before_started", "keyed"): (1, "succeeded"),
    ("before_started", "unsafe"): (1, "succeeded"),
    ("after_started", "safe"): (1, "succeeded"),
    ("after_started", "keyed"): (1, "succeeded"),
    ("after_started", "unsafe"): (0, "uncertain"),
    ("after_tool", "safe"): (2, "succeeded"),
    ("after_tool", "keyed"): (2, "succeeded"),
    ("after_tool", "unsafe"): (1, "uncertain"),
    ("after_outcome", "safe"): (1, "succeeded"),
    ("after_outcome", "keyed"): (1, "succeeded"),
    ("after_outcome", "unsafe"): (1, "succeeded"),
}


@pytest.mark.parametrize(("boundary", "klass"), sorted(EXPECTED))
async def test_crash_at_every_boundary_recovers_by_class(
    queue: Queue, clock: ManualClock, counter: tuple[Counter, str], boundary: str, klass: str
) -> None:
    seen, base = counter
    args = {**CALLS[klass], "url": f"{base}/effect"}
    args_without_flag = {k: v for k, v in args.items() if k != "idempotency_key"}
    run = await queue.enqueue(
        scripted(
            {
                "call": "http_request",
                "args": args_without_flag,
                **({"idempotency_key": True} if klass == "keyed" else {}),
            },
            {"final": "done"},
        )
    )

    def crash(at: str, step: int) -> None:
        if (at, step) == (boundary, 1):
            raise SimulatedCrash(at)

    assert await execute_once(queue, runtime(crash)) is False
    await recover(queue, clock)
    assert await execute_once(queue, runtime()) is True

    hits, status = EXPECTED[(boundary, klass)]
    finished = await current(queue, run.id)
    assert finished.status == "succeeded", finished.failure
    assert finished.attempts == 2
    outcome = finished.result["tool_outcomes"][0]
    assert (len(seen.hits), outcome["status"]) == (hits, status), seen.hits
    if status == "uncertain":
        assert "unknown" in outcome["outcome"]["message"]
    if klass == "keyed":
        keys = {key for _, _, key in seen.hits}
        assert keys == {f"turnstile-{run.id}-step-1"}
    else:
        assert {key for _, _, key in seen.hits} <= {None}
    await check_all_runs(queue.engine)
    journal = await queue.journal(run.id)
    epochs = [entry.epoch for entry in journal]
    assert epochs == sorted(epochs)


async def test_a_fenced_worker_makes_no_further_tool_call(
    queue: Queue, counter: tuple[Counter, str]
) -> None:
    seen, base = counter
    run = await queue.enqueue(
        scripted(
            {"call": "http_request", "args": {"method": "POST", "url": f"{base}/one"}},
            {"call": "http_request", "args": {"method": "POST", "url": f"{base}/two"}},
            {"final": "done"},
        )
    )

    async def cancel_during_the_call() -> None:
        await queue.cancel(run.id, actor="test")

    seen.on_hit = cancel_during_the_call
    assert await execute_once(queue, runtime()) is True
    assert [path for _, path, _ in seen.hits] == ["/one"]
    events = await queue.events(run.id)
    assert [e.type for e in events][-4:] == [
        "tool.started",
        "tool.finished",
        "run.cancelled",
        "run.fenced",
    ]
    # The cancel settled the POST it interrupted (its effect unknown); the worker's own
    # outcome for it was fenced.
    assert events[-3].data["outcome_status"] == "uncertain"
    assert events[-3].data["by"] == "cancel"
    assert events[-1].data["during"] == "tool_finished"


async def test_transient_errors_are_retried_then_succeed(
    queue: Queue, counter: tuple[Counter, str]
) -> None:
    seen, base = counter
    seen.fail_first = 2
    run = await queue.enqueue(
        scripted(
            {"call": "http_request", "args": {"method": "GET", "url": f"{base}/flaky"}},
        )
    )
    assert await execute_once(queue, runtime())
    finished = await current(queue, run.id)
    assert finished.status == "succeeded"
    assert len(seen.hits) == 3
    assert finished.attempts == 1


async def test_transient_errors_that_persist_release_the_run_early(
    queue: Queue, clock: ManualClock, counter: tuple[Counter, str]
) -> None:
    seen, base = counter
    seen.fail_first = 100
    run = await queue.enqueue(
        scripted(
            {"call": "http_request", "args": {"method": "GET", "url": f"{base}/down"}},
        )
    )
    assert await execute_once(queue, runtime(transient_retries=2))
    released = await current(queue, run.id)
    assert (released.status, released.attempts) == ("queued", 1)
    assert released.scheduled_for is not None
    assert released.scheduled_for > clock.now
    assert len(seen.hits) == 3
    assert (await queue.events(run.id))[-1].type == "run.released"


async def test_an_unsafe_call_answered_503_is_uncertain_not_retried(
    queue: Queue, counter: tuple[Counter, str]
) -> None:
    seen, base = counter
    seen.fail_first = 1
    run = await queue.enqueue(
        scripted(
            {"call": "http_request", "args": {"method": "POST", "url": f"{base}/pay"}},
        )
    )
    assert await execute_once(queue, runtime())
    finished = await current(queue, run.id)
    assert len(seen.hits) == 1
    assert finished.result["tool_outcomes"][0]["status"] == "uncertain"


@pytest.mark.parametrize(
    ("step", "kind"),
    [
        ({"call": "teleport"}, "unknown_tool"),
        ({"call": "sleep", "args": {"seconds": "soon"}}, "tool_error"),
        (
            {"call": "http_request", "args": {"method": "GET", "url": "http://10.1.2.3/"}},
            "tool_error",
        ),
        ({"nothing": 1}, "agent_error"),
    ],
)
async def test_permanent_errors_fail_the_run_at_once(
    queue: Queue, step: dict[str, Any], kind: str
) -> None:
    run = await queue.enqueue(scripted(step))
    assert await execute_once(queue, runtime())
    failed = await current(queue, run.id)
    assert (failed.status, failed.failure["kind"], failed.attempts) == ("failed", kind, 1)


async def test_the_time_limit_fails_the_run_with_timeout(queue: Queue) -> None:
    run = await queue.enqueue(scripted({"call": "sleep", "args": {"seconds": 30}}))
    assert await execute_once(queue, runtime(default_time_limit_seconds=0.2))
    failed = await current(queue, run.id)
    assert (failed.status, failed.failure["kind"]) == ("failed", "timeout")


async def test_the_allow_list(counter: tuple[Counter, str]) -> None:
    seen, base = counter
    port = base.rsplit(":", 1)[1]
    ctx = ToolContext(run_id="r", step=1, idempotency_key=None)
    everywhere = HttpRequestTool(["*"])
    for url in (
        f"http://127.0.0.1:{port}/x",
        "http://localhost/x",
        "http://10.0.0.8/x",
        "http://192.168.1.1/x",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/x",
    ):
        with pytest.raises(PermanentToolError, match=r"internal address|link-local"):
            await everywhere.run({"method": "GET", "url": url}, ctx)
    only_example = HttpRequestTool(["*.example.com"])
    with pytest.raises(PermanentToolError, match="not on the allow-list"):
        await only_example.run({"method": "GET", "url": f"http://127.0.0.1:{port}/x"}, ctx)
    assert seen.hits == []  # nothing was sent for any refusal
    named = HttpRequestTool(["127.0.0.1"])
    answer = await named.run({"method": "GET", "url": f"http://127.0.0.1:{port}/x"}, ctx)
    assert answer["status"] == 200
    assert len(seen.hits) == 1


async def test_ask_the_user_twice_through_the_api(
    database_url: str, engine: Any, counter: tuple[Counter, str]
) -> None:
    _, base = counter
    async with running_api(
        database_url, engine, workers=True, http_allowed_hosts="127.0.0.1"
    ) as api:
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]
        script = {
            "script": [
                {"call": "http_request", "args": {"method": "GET", "url": f"{base}/balance"}},
                {"ask": "Which account?"},
                {"call": "echo", "args": {"step": "between"}},
                {"ask": "Confirm?"},
                {"final": "done"},
            ]
        }
        run_id = (await client.post(f"/sessions/{session}/turns", json={"input": script})).json()[
            "id"
        ]

        async def reaches(status: str, question: str | None = None) -> dict[str, Any]:
            async def check() -> dict[str, Any] | None:
                run: dict[str, Any] = (
                    await client.get(f"/runs/{run_id}", params={"wait": 5, "status": "queued"})
                ).json()
                if run["status"] == status and (question is None or run["question"] == question):
                    return run
                return None

            return await eventually(check, within=20, what=f"run {status}")

        await reaches("waiting_for_user", "Which account?")
        assert (await client.post(f"/sessions/{session}/turns", json={"input": "acct-7"})).json()[
            "id"
        ] == run_id
        await reaches("waiting_for_user", "Confirm?")
        await client.post(f"/sessions/{session}/turns", json={"input": "yes"})
        done = await reaches("succeeded")
        assert done["result"]["answers"] == ["acct-7", "yes"]
        assert [t["tool"] for t in done["result"]["tool_outcomes"]] == ["http_request", "echo"]
        assert done["result"]["final"] == "done"
        types = [e["type"] for e in (await client.get(f"/runs/{run_id}/events")).json()["events"]]
        assert types.count("run.waiting") == 2
        assert types.count("run.input_delivered") == 2
        # Each resume started from the checkpoint: the first tool ran once.
        assert types.count("tool.started") == 2
    await check_all_runs(engine)


async def test_no_script_answers_with_the_input(queue: Queue) -> None:
    run = await queue.enqueue(
        NewRun(tenant_id="t", principal="p", agent="scripted", input={"text": "hello"})
    )
    assert await execute_once(queue, runtime())
    assert (await current(queue, run.id)).result == {
        "final": {"text": "hello"},
        "tool_outcomes": [],
        "answers": [],
    }


async def test_plugins_add_agents_and_tools(database_url: str, engine: Any) -> None:
    async with running_api(
        database_url, engine, workers=True, plugins="tests.support.example_plugin:register"
    ) as api:
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]
        turn = await client.post(
            f"/sessions/{session}/turns", json={"input": "hello", "agent": "shop"}
        )
        run_id = turn.json()["id"]

        async def state(status: str) -> dict[str, Any] | None:
            run: dict[str, Any] = (
                await client.get(f"/runs/{run_id}", params={"wait": 5, "status": "queued"})
            ).json()
            return run if run["status"] == status else None

        waiting = await eventually(lambda: state("waiting_for_user"), within=20)
        assert waiting["question"] == "What should I order?"
        await client.post(f"/sessions/{session}/turns", json={"input": "a book"})
        done = await eventually(lambda: state("succeeded"), within=20)
        assert done["result"]["ordered"]["item"] == "a book"
        assert done["result"]["status"] == "succeeded"
        journal = await api.queue.journal(UUID(run_id))
        assert {(e.idempotency_class, e.idempotency_key) for e in journal} == {
            ("keyed", f"turnstile-{run_id}-step-1")
        }


async def test_an_unsafe_call_that_never_left_is_planned_again_not_taken_as_done(
    queue: Queue, clock: ManualClock
) -> None:
    """Retries of a call refused before sending ran out: the journal closes it as not sent
    (neither done nor uncertain), and the next attempt makes the call for real. It used to be
    recorded as failed, and the run then succeeded with a tool that never ran."""
    from app.store.embedded import free_port

    port = free_port()  # nothing listens there yet: every attempt is refused before sending
    run = await queue.enqueue(
        scripted(
            {
                "call": "http_request",
                "args": {"method": "POST", "url": f"http://127.0.0.1:{port}/"},
            },
            {"final": "done"},
        )
    )
    assert await execute_once(queue, runtime(transient_retries=1))
    released = await current(queue, run.id)
    assert (released.status, released.attempts) == ("queued", 1)
    assert [e.entry for e in await queue.journal(run.id)] == ["started", "not_sent"]

    requests: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    try:
        clock.advance(3600)
        assert await execute_once(queue, runtime())
    finally:
        server.close()
        await server.wait_closed()
    done = await current(queue, run.id)
    assert done.status == "succeeded"
    assert len(requests) == 1  # the call was made, once
    outcome = done.result["tool_outcomes"][0]
    assert outcome["status"] == "succeeded"
    assert [e.entry for e in await queue.journal(run.id)] == [
        "started",
        "not_sent",
        "started",
        "finished",
    ]


async def test_metadata_shared_and_embedded_addresses_are_refused() -> None:
    ctx = ToolContext(run_id="r", step=1, idempotency_key=None)
    everywhere = HttpRequestTool(["*"])
    for url in (
        "http://100.100.100.200/latest",
        "http://100.64.1.1/",
        "http://[2002:a9fe:a9fe::1]/",
        "http://[fec0::1]/",
        "http://[64:ff9b::a9fe:a9fe]/",
        "http://0.0.0.0/",
    ):
        with pytest.raises(PermanentToolError, match=r"internal address|link-local"):
            await everywhere.run({"method": "GET", "url": url}, ctx)


async def test_a_steered_input_survives_a_crash_and_is_not_taken_for_an_answer(
    queue: Queue, clock: ManualClock
) -> None:
    """A steer the run took before it crashed (docs/turn-control.md) comes back with it on
    recovery, set apart from the answers: the run still asks its question."""
    from app.queue.reads import Reads
    from app.queue.submit import RunSpec, Submissions, Submitter

    submissions = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=60,
        idempotency_wait_seconds=1,
        lock_timeout_ms=2000,
    )
    who = Submitter(tenant_id="t", principal="p")
    session = await Reads(queue).create_session(tenant_id="t", principal="p")
    script = {"script": [{"call": "echo", "args": {}}, {"ask": "which?"}, {"final": "ok"}]}
    first = await submissions.submit_turn(who, session.id, RunSpec(input=script))
    await submissions.submit_turn(who, session.id, RunSpec(input="steer"), multitask="steer")

    def crash(at: str, step: int) -> None:
        if at == "after_tool":
            raise SimulatedCrash(at)

    assert await execute_once(queue, runtime(crash)) is False
    assert await queue.steered_inputs(first.run_id) == [("steer", 2, 1)]
    await recover(queue, clock)
    assert await execute_once(queue, runtime())
    waiting = await current(queue, first.run_id)
    assert waiting.status == "waiting_for_user"  # the steer did not answer the question
    answered = await submissions.submit_turn(who, session.id, RunSpec(input="that one"))
    assert answered.run_id == first.run_id
    assert await execute_once(queue, runtime())
    done = await current(queue, first.run_id)
    assert done.status == "succeeded", done.failure
    assert done.result["answers"] == ["that one"]
    assert done.result["steered"] == ["steer"]
    assert await check_all_runs(queue.engine) == 1
