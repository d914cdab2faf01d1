"""The queue's depth is read without scanning the active runs (issue 40, item 10).

The queue-metrics service reads the depth per class and status at every interval, and the
runbook's stats on demand. It counted every queued, running and waiting run: one scan of the
active runs each time, however deep the queue. Now running runs come from the count rows, queued
and waiting runs are counted through their partial indexes, at most a bound of them, and the
oldest eligible age is one probe per priority. The planner's choice is read from EXPLAIN on a
queue of 20,000 queued, 20,000 running and 2,000 waiting runs, analysed.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.queue.reads import Reads
from app.store.statements import statements
from app.vocabulary.classes import PriorityClass

FILL = """
INSERT INTO runs (tenant_id, principal, agent, input, priority, status, lease_owner,
                  lease_expires_at, question, started_at)
SELECT 'tenant-' || (g % 50), 'p', 'scripted', '{}'::jsonb, 10 + g % 3,
       s.status,
       CASE WHEN s.status = 'running' THEN 'w' END,
       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'waiting_for_user' THEN '{"ask": 1}'::jsonb END,
       CASE WHEN s.status <> 'queued' THEN now() END
FROM (VALUES ('queued', 20000), ('running', 20000), ('waiting_for_user', 2000))
         AS s(status, n),
     LATERAL generate_series(1, s.n) AS g
"""
COUNTS = """
INSERT INTO tenant_class_counts (tenant_id, band, running, has_work)
SELECT tenant_id, priority / 10, count(*) FILTER (WHERE status = 'running'), true
FROM runs GROUP BY 1, 2
"""


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found.extend(_nodes(child))
    return found


async def test_the_depth_scans_no_active_runs(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(FILL))
        await conn.execute(text(COUNTS))
    async with engine.connect() as conn:
        await conn.execute(text("ANALYZE runs"))
        await conn.execute(text("ANALYZE tenant_class_counts"))
        for tenant in (None, "tenant-7"):
            explained = await conn.scalar(
                text(f"EXPLAIN (FORMAT JSON) {statements()['queue_depth'].sql}"),
                {"tenant_id": tenant, "now": None, "max_counted": 1_000_000},
            )
            plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]
            scans = [
                node
                for node in _nodes(plan["Plan"])
                if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "runs"
            ]
            assert not scans, (tenant, json.dumps(plan, indent=1)[:3000])
    depth = await Reads(Queue(engine)).depth(tenant_id=None)
    assert depth[PriorityClass.ASYNC].queued == 20000
    assert depth[PriorityClass.ASYNC].running == 20000
    assert depth[PriorityClass.ASYNC].waiting_for_user == 2000
    assert depth[PriorityClass.INTERACTIVE].queued == 0
    mine = await Reads(Queue(engine)).depth(tenant_id="tenant-7")
    assert mine[PriorityClass.ASYNC].queued == 400
    assert mine[PriorityClass.ASYNC].running == 400
    assert mine[PriorityClass.ASYNC].waiting_for_user == 40
