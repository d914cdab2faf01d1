"""The queue's named statements: `queries.sql` (runs, their transitions, sessions, idempotency,
workers and maintenance) and `dashboard.sql` (the operator dashboard's read models), in the
format of app/db/statements.py. Only app/queue executes them."""

from __future__ import annotations

from sqlalchemy import TextClause

from app.db.statements import Statement, load_statements, parse

FILES = ("queries.sql", "dashboard.sql")

__all__ = ["FILES", "Statement", "parse", "q", "statements"]


def statements() -> dict[str, Statement]:
    return load_statements("app.queue", FILES)


def q(name: str) -> TextClause:
    """The named statement, ready to execute."""
    return statements()[name].clause
