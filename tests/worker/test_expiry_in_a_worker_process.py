"""Start deadlines against a real `turnstile worker` process (docs/start-deadlines.md): with its
one interactive slot busy (a backlog), a turn whose deadline passes ends `cancelled` with reason
`expired` at its deadline, long before the sweep interval, never claimed, and its session takes
the next turn; an async run with a deadline it meets is claimed and succeeds."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import running_api
from tests.support.processes import turnstile
from tests.support.waiting import eventually


async def test_a_turn_past_its_deadline_expires_promptly_while_the_slot_is_busy(
    database_url: str, engine: AsyncEngine
) -> None:
    queue = Queue(engine)
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_SLOTS": "interactive:1,async:1,maintenance:1",
        # Neither the sweep's pace (the expirer's longest sleep) nor polling explains what
        # happens within this test: only the deadline's own wake-up does.
        "TURNSTILE_SWEEP_INTERVAL_SECONDS": "60",
        "TURNSTILE_POLL_INTERVAL_SECONDS": "60",
        "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
    }
    async with (
        turnstile("worker", ready=b"running slots", env=env),
        running_api(database_url, engine) as api,
    ):
        blocker = await queue.enqueue(
            NewRun(
                tenant_id="acme",
                principal="ops",
                agent="scripted",
                input={"script": [{"call": "sleep", "args": {"seconds": 30}}]},
                priority=PriorityClass.INTERACTIVE.base,
            )
        )

        async def blocking() -> bool:
            return "tool.started" in [e.type for e in await queue.events(blocker.id)]

        await eventually(blocking, within=20, what="the blocker holding the interactive slot")
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]
        late = await client.post(
            f"/sessions/{session}/turns", json={"input": "hi", "start_within": 1}
        )
        assert late.status_code == 202, late.text
        met = await client.post("/runs", json={"input": {}, "start_within": 30})
        assert met.status_code == 202, met.text

        async def status(run_id: str, wanted: str) -> Any:
            doc = (await client.get(f"/runs/{run_id}")).json()
            return doc if doc["status"] == wanted else None

        expired = await eventually(
            lambda: status(late.json()["id"], "cancelled"), within=15, what="the expiry"
        )
        assert (expired["attempts"], expired["started_at"]) == (0, None)
        events = (await client.get(f"/runs/{expired['id']}/events")).json()["events"]
        assert [e["type"] for e in events] == ["run.created", "run.cancelled"]
        assert events[-1]["data"] == {"by": "expirer", "reason": "expired"}
        # The session is free again: its next turn is a new run.
        again = await client.post(f"/sessions/{session}/turns", json={"input": "again"})
        assert again.status_code == 202, again.text
        assert again.json()["session_run_no"] == 2
        await eventually(lambda: status(met.json()["id"], "succeeded"), within=15, what="met")
