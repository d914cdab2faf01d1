"""Class-dedicated workers (docs/adr/0005): a real `turnstile worker` with a partial layout
serves only its classes, and a class with queued runs and no live slot anywhere is reported
by the metrics, the dashboard and `turnstile queue stats`."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.queue_metrics import QueueMetrics
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.reads import Reads
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.observability.test_metrics import samples, value
from tests.support.api import running_api
from tests.support.processes import run_cli, turnstile
from tests.support.waiting import eventually
from tests.ui.test_dashboard_http import signed_in

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass
STALE_SECONDS = 30.0


def run_of(klass: PriorityClass) -> NewRun:
    return NewRun(
        tenant_id="acme",
        principal="alice",
        agent="scripted",
        input={"script": [{"final": klass.value}]},
        priority=klass.base,
    )


async def test_a_layout_without_every_class_is_refused_unless_partial(database_url: str) -> None:
    code, _, err = await run_cli(
        "worker", env={"DATABASE_URL": database_url, "TURNSTILE_SLOTS": "async:2"}
    )
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "TURNSTILE_PARTIAL_LAYOUT" in err


async def test_an_async_only_worker_and_the_class_it_leaves_unserved(
    database_url: str, engine: AsyncEngine
) -> None:
    queue = Queue(engine)
    reads = Reads(queue)
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_SLOTS": "async:2",
        "TURNSTILE_PARTIAL_LAYOUT": "true",
    }
    async with turnstile("worker", ready=b"running slots", env=env):
        waiting = await queue.enqueue(run_of(INTERACTIVE))
        done = await queue.enqueue(run_of(ASYNC))

        async def succeeded() -> bool:
            run = await queue.get_run(done.id)
            return run is not None and run.status == "succeeded"

        await eventually(succeeded, within=20, what="the async run")
        # The interactive run was enqueued first and is still queued: no slot serves it.
        still = await queue.get_run(waiting.id)
        assert still is not None
        assert still.status == "queued"
        assert await reads.live_slots(stale_seconds=STALE_SECONDS) == {
            INTERACTIVE: 0,
            ASYNC: 2,
            MAINTENANCE: 0,
        }

        # The metrics: a gauge per class (the alert in docs/operations.md watches it).
        metrics = Metrics()
        await QueueMetrics(
            queue, metrics, holder="test", interval=60, stale_seconds=STALE_SECONDS
        ).run_once()
        found = samples(generate_latest(metrics.registry).decode())
        assert value(found, "turnstile_class_unserved", **{"class": "interactive"}) == 1
        assert value(found, "turnstile_class_unserved", **{"class": "async"}) == 0
        assert value(found, "turnstile_class_unserved", **{"class": "maintenance"}) == 0
        assert value(found, "turnstile_class_live_slots", **{"class": "async"}) == 2

        # `turnstile queue stats`: the table says it, and so does a line on stderr.
        code, out, err = await run_cli(
            "queue", "stats", "--json", env={"DATABASE_URL": database_url}
        )
        assert code == 0, err
        rows: list[dict[str, Any]] = json.loads(out)
        queued = {row["class"]: row for row in rows if row["status"] == "queued"}
        assert queued["interactive"]["unserved"] is True
        assert queued["interactive"]["live_slots"] == 0
        assert queued["async"]["unserved"] is False
        assert queued["async"]["live_slots"] == 2
        assert "interactive has 1 queued runs and no live worker slot" in err
        code, out, _ = await run_cli("queue", "stats", env={"DATABASE_URL": database_url})
        assert "class=interactive  status=queued  runs=1  " in out
        assert "unserved=True" in out

        # The dashboard's overview, and the API's runbook view.
        async with running_api(database_url, engine) as api:
            key = await api.key("acme", "ops", "operator")
            client = await signed_in(api, key)
            page = (await client.get("/ui/overview/fragment")).text
            stats = (
                await client.get("/queue/stats", headers={"Authorization": f"Bearer {key}"})
            ).json()["classes"]
        assert stats["interactive"]["unserved"] is True
        assert stats["async"]["live_slots"] == 2
        assert stats["async"]["unserved"] is False
        assert 'data-testid="unserved" data-unserved-class="interactive"' in page
        assert 'data-class="async"' in page
        assert 'data-testid="unserved" data-unserved-class="async"' not in page

    # The worker drained and deregistered: nothing serves async any more.
    assert (await reads.live_slots(stale_seconds=STALE_SECONDS))[ASYNC] == 0
