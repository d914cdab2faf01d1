"""The expirer's reads cost one probe of `ix_runs_start_before`, never a scan of the queue
(docs/start-deadlines.md): on 20,000 queued runs without a deadline and 200 with one, analysed,
`overdue_runs` and `next_start_deadline` read the partial index, and it holds only the runs
with a deadline."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import statements

FILL = """
INSERT INTO runs (tenant_id, principal, agent, input, priority, status, start_before)
SELECT 'tenant-' || (g % 50), 'p', 'scripted', '{}'::jsonb, 10,
       'queued', CASE WHEN g % 100 = 0 THEN now() + g * interval '1 second' END
FROM generate_series(1, 20000) AS g
"""


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found.extend(_nodes(child))
    return found


async def test_the_expirers_reads_probe_their_partial_index(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(FILL))
    async with engine.connect() as conn:
        await conn.execute(text("ANALYZE runs"))
        for name, params in (
            ("overdue_runs", {"limit": 500, "now": None}),
            ("next_start_deadline", {"now": None}),
        ):
            explained = await conn.scalar(
                text(f"EXPLAIN (FORMAT JSON) {statements()[name].sql}"), params
            )
            plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]
            used = {
                node.get("Index Name")
                for node in _nodes(plan["Plan"])
                if node.get("Relation Name") == "runs"
            }
            assert used == {"ix_runs_start_before"}, (name, json.dumps(plan, indent=1)[:3000])
        indexed = await conn.scalar(
            text("SELECT reltuples FROM pg_class WHERE relname = 'ix_runs_start_before'")
        )
        assert indexed == 200
