"""A cancel settles the unsafe calls it leaves open (issue 33 item 4, the defect found by the
review): cancelling a run in the middle of an unsafe call (say `send_email`) used to record no
outcome at all, so the transcript, which takes tool calls from `tool.finished`, and the
session's next run never learnt the call was made. Now the cancel writes, in its own
statement, the call's `uncertain` journal outcome and its `tool.finished` event before
`run.cancelled`, as a dead letter does; the worker's late outcome is fenced; and the next
run's history pairs the call with an "unknown" result."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from turnstile_client import AsyncTurnstile

from app.queue.core import Queue
from app.queue.reads import Reads
from app.runtime.history import ABANDONED_RESULT, UNKNOWN_RESULT, chat_messages
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, ToolCall, Written
from tests.support.api import running_api
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

EMAIL = ToolCall(step=2, tool="send_email", idempotency_class="unsafe", args={"to": "a@b.c"})
LOOKUP = ToolCall(step=1, tool="lookup", idempotency_class="safe", args={"q": "x"})


async def started_session_run(queue: Queue) -> tuple[Reads, Any, Lease]:
    reads = Reads(queue)
    session = await reads.create_session(tenant_id="t", principal="p")
    await queue.enqueue(
        NewRun(
            tenant_id="t",
            principal="p",
            agent="scripted",
            session_id=session.id,
            input={"text": "mail the report"},
        )
    )
    [claimed] = await queue.claim("w", list(PriorityClass), limit=1)
    lease = claimed.lease
    assert isinstance(await queue.tool_started(lease, LOOKUP), Written)
    assert isinstance(
        await queue.tool_finished(lease, LOOKUP, "succeeded", {"found": 1}, {"s": 1}), Written
    )
    assert isinstance(await queue.tool_started(lease, EMAIL), Written)
    return reads, session, lease


async def test_a_cancel_mid_unsafe_call_records_its_outcome_as_unknown(queue: Queue) -> None:
    reads, session, lease = await started_session_run(queue)
    outcome = await queue.cancel(lease.run_id, actor="key:ops", reason="user left")
    assert outcome.changed

    events = await queue.events(lease.run_id)
    assert [e.type for e in events][-2:] == ["tool.finished", "run.cancelled"]
    settled = events[-2].data
    assert settled["outcome_status"] == "uncertain"
    assert (settled["tool"], settled["step"], settled["by"]) == ("send_email", 2, "cancel")
    # The events' numbers have no hole: the uncertain outcome sits just before the cancel.
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    journal = {entry.step: entry for entry in await queue.journal(lease.run_id)}
    assert journal[2].entry == "finished"
    assert journal[2].outcome_status == "uncertain"
    assert journal[2].event_seq == events[-2].seq
    assert journal[1].outcome_status == "succeeded"  # a finished call is left as it was

    # The worker's own outcome, when its call returns, is fenced: the record stands.
    late = await queue.tool_finished(lease, EMAIL, "succeeded", {"sent": True}, {"s": 2})
    assert isinstance(late, Fenced)
    assert [e.type for e in await queue.events(lease.run_id)] == [e.type for e in events]

    # The transcript has the call, with its arguments and an unknown outcome, and the next
    # run's history pairs the assistant's call with its tool message.
    page = await reads.session_transcript_page(session.id, cursor=None, limit=50)
    tools = [entry for entry in page.entries if entry.role == "tool"]
    assert [t.tool["name"] for t in tools] == ["lookup", "send_email"]
    assert tools[1].tool["status"] == "uncertain"
    assert tools[1].tool["args"] == {"to": "a@b.c"}
    messages = chat_messages([entry.to_json() for entry in page.entries])
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    answers = [m for m in messages if m["role"] == "tool"]
    assert len(calls) == len(answers) == 2
    ids = [m["tool_calls"][0]["id"] for m in calls]  # type: ignore[index]
    assert [m["tool_call_id"] for m in answers] == ids
    assert UNKNOWN_RESULT in str(answers[1]["content"])
    assert await check_all_runs(queue.engine) == 1


async def test_a_cancel_of_a_requeued_run_settles_the_call_its_recovery_would_have(
    queue: Queue, clock: ManualClock
) -> None:
    _, _, lease = await started_session_run(queue)
    clock.advance(31)  # the worker died inside the email call; its lease lapses
    assert (await queue.sweep()).requeued == 1
    # Requeued, the call is left open for the next attempt's recovery...
    assert [e.entry for e in await queue.journal(lease.run_id)][-1] == "started"
    # ...which a cancel means will never run: the cancel settles it.
    assert (await queue.cancel(lease.run_id, actor="key:ops")).changed
    journal = await queue.journal(lease.run_id)
    assert (journal[-1].entry, journal[-1].outcome_status) == ("finished", "uncertain")
    assert [e.type for e in await queue.events(lease.run_id)][-2:] == [
        "tool.finished",
        "run.cancelled",
    ]
    assert await check_all_runs(queue.engine) == 1


async def test_a_cancel_with_no_open_call_writes_only_its_own_event(queue: Queue) -> None:
    _, _, lease = await started_session_run(queue)
    assert isinstance(
        await queue.tool_finished(lease, EMAIL, "succeeded", {"sent": True}, {"s": 2}), Written
    )
    before = len(await queue.events(lease.run_id))
    assert (await queue.cancel(lease.run_id, actor="key:ops")).changed
    events = await queue.events(lease.run_id)
    assert len(events) == before + 1
    assert events[-1].type == "run.cancelled"
    assert await check_all_runs(queue.engine) == 1


async def test_a_safe_or_keyed_call_left_open_by_a_cancel_is_abandoned(queue: Queue) -> None:
    reads, session, lease = await started_session_run(queue)
    assert isinstance(
        await queue.tool_finished(lease, EMAIL, "succeeded", {"sent": True}, {"s": 2}), Written
    )
    fetch = ToolCall(step=3, tool="fetch", idempotency_class="keyed", args={}, idempotency_key="k")
    assert isinstance(await queue.tool_started(lease, fetch), Written)
    assert (await queue.cancel(lease.run_id, actor="key:ops")).changed
    events = await queue.events(lease.run_id)
    assert [e.type for e in events][-2:] == ["tool.finished", "run.cancelled"]
    assert events[-2].data["outcome_status"] == "abandoned"
    journal = await queue.journal(lease.run_id)
    assert (journal[-1].step, journal[-1].outcome_status) == (3, "abandoned")
    page = await reads.session_transcript_page(session.id, cursor=None, limit=50)
    messages = chat_messages([entry.to_json() for entry in page.entries])
    answers = [m for m in messages if m["role"] == "tool"]
    assert len(answers) == 3
    assert ABANDONED_RESULT in str(answers[2]["content"])
    assert await check_all_runs(queue.engine) == 1


async def test_a_dead_letter_settles_every_open_call_and_names_the_unsafe_ones(
    queue: Queue, clock: ManualClock
) -> None:
    await queue.enqueue_many(
        tenant_id="t",
        principal="p",
        runs=[("scripted", {}, PriorityClass.ASYNC.base, None)],
        max_attempts=1,
    )
    [claimed] = await queue.claim("w", list(PriorityClass), limit=1)
    lease = claimed.lease
    lookup = ToolCall(step=1, tool="lookup", idempotency_class="safe", args={})
    payment = ToolCall(step=2, tool="pay", idempotency_class="unsafe", args={})
    assert isinstance(await queue.tool_started(lease, lookup), Written)  # parallel calls
    assert isinstance(await queue.tool_started(lease, payment), Written)
    clock.advance(31)  # the worker died inside both; no attempt is left
    assert (await queue.sweep()).failed == 1
    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert run.failure is not None
    assert run.failure["uncertain_calls"] == [{"step": 2, "tool": "pay"}]
    assert "lookup" not in run.failure["message"]
    settled = {e.data["step"]: e.data["outcome_status"] for e in await queue.events(lease.run_id)
               if e.type == "tool.finished"}  # fmt: skip
    assert settled == {1: "abandoned", 2: "uncertain"}
    assert await check_all_runs(queue.engine) == 1


async def test_a_cancel_through_the_api_and_the_client_says_why(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client("acme", "alice")
        first = (await client.post("/runs", json={"input": {"final": "x"}})).json()
        cancelled = await client.post(f"/runs/{first['id']}/cancel", json={"reason": "user left"})
        assert cancelled.status_code == 200, cancelled.text
        async with AsyncTurnstile(api.base, await api.key("acme", "alice")) as sdk:
            second = await sdk.submit_run({"final": "y"})
            assert (await sdk.cancel(second.id, reason="changed my mind")).status == "cancelled"
        too_long = await client.post(f"/runs/{first['id']}/cancel", json={"reason": "x" * 501})
        assert too_long.status_code == 422
        bare = (await client.post("/runs", json={"input": {"final": "z"}})).json()
        assert (await client.post(f"/runs/{bare['id']}/cancel")).status_code == 200
        reasons = []
        for run_id in (first["id"], second.id, bare["id"]):
            events = (await client.get(f"/runs/{run_id}/events")).json()["events"]
            reasons.append(events[-1]["data"]["reason"])
    assert reasons == ["user left", "changed my mind", "cancelled through the API"]
