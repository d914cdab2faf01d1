"""The plans of the statements a PL/pgSQL function runs, read through auto_explain.

EXPLAIN of a statement that calls a function shows one Function Scan; the claim and the
creation of runs are functions (app/store/functions/). auto_explain, loaded in the test's own
session with `log_nested_statements`, logs the plan of every statement inside them, and with
`client_min_messages = log` the server sends those lines to this client as notices, which
asyncpg hands to a log listener. PostgreSQL ships auto_explain with the server (a contrib
module); the embedded server's bundle may lack it, in which case the caller skips (or, under
TURNSTILE_REQUIRE_SYSTEM_TESTS=1, fails), as for any other system tool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncConnection

PlanNode = dict[str, Any]


@dataclass(frozen=True)
class NestedPlan:
    """One statement's text and its plan (EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)'s `Plan`)."""

    query: str
    plan: PlanNode

    def nodes(self) -> Iterator[PlanNode]:
        stack = [self.plan]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.get("Plans", []))

    @property
    def buffers(self) -> int:
        """Shared buffers the statement touched (hit and read), as its top node reports."""
        return int(self.plan.get("Shared Hit Blocks", 0)) + int(
            self.plan.get("Shared Read Blocks", 0)
        )


class AutoExplainMissing(RuntimeError):
    pass


async def start_explaining(conn: AsyncConnection, *, generic: bool = False) -> list[NestedPlan]:
    """Turn auto_explain on for this connection's session; the returned list fills with the
    plan of every statement that runs on it from now on, nested ones included. The driver hands
    the notices to its listener on the event loop: read the list after a later round trip."""
    raw = await conn.get_raw_connection()
    driver: asyncpg.Connection = raw.driver_connection  # type: ignore[assignment]
    return await explaining(driver, generic=generic)


async def explaining(driver: asyncpg.Connection, *, generic: bool = False) -> list[NestedPlan]:
    """`start_explaining` on a plain asyncpg connection."""
    try:
        await driver.execute("LOAD 'auto_explain'")
    except asyncpg.PostgresError as exc:
        raise AutoExplainMissing(str(exc)) from exc
    settings = {
        "auto_explain.log_min_duration": "0",
        "auto_explain.log_nested_statements": "on",
        "auto_explain.log_analyze": "on",
        "auto_explain.log_buffers": "on",
        "auto_explain.log_timing": "off",
        "auto_explain.log_format": "json",
        "client_min_messages": "log",
    }
    if generic:
        settings["plan_cache_mode"] = "force_generic_plan"
    for name, value in settings.items():
        await driver.execute(f"SET {name} = '{value}'")
    plans: list[NestedPlan] = []

    def listen(_: object, message: asyncpg.PostgresLogMessage) -> None:
        text = str(message.message)
        start = text.find("{")
        if not text.startswith("duration:") or start < 0:
            return
        document = json.loads(text[start:])
        plans.append(NestedPlan(query=str(document.get("Query Text", "")), plan=document["Plan"]))

    driver.add_log_listener(listen)  # type: ignore[arg-type]
    return plans
