"""The queue's named statements, in the format of app/db/statements.py, one file per concern:
`runs.sql` (the transitions of runs: claims, fenced writes, the sweep, cancel), `reads.sql`
(runs, their events, the runbook), `submission.sql` (sessions, idempotency keys, turn routing,
operator actions), `workers.sql` (the worker registry, maintenance leases, prunes),
`dashboard.sql` (the dashboard's read models), `schedules.sql` (schedules and their ticks),
`webhooks.sql` (webhook endpoints) and `tenants.sql` (tenants' limits, allowances and counts).
Names are unique across them (the loader refuses a duplicate). Only app/queue executes them."""

from __future__ import annotations

from sqlalchemy import TextClause

from app.db.statements import Statement, load_statements, parse

FILES = (
    "runs.sql",
    "reads.sql",
    "submission.sql",
    "workers.sql",
    "dashboard.sql",
    "schedules.sql",
    "webhooks.sql",
    "tenants.sql",
)

__all__ = ["FILES", "Statement", "parse", "q", "statements"]


def statements() -> dict[str, Statement]:
    return load_statements("app.queue", FILES)


def q(name: str) -> TextClause:
    """The named statement, ready to execute."""
    return statements()[name].clause
