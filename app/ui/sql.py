"""Loads the dashboard's named statements (`app/ui/queries.sql`) once, at first use.

Same format and parser as the queue's statements (app/queue/sql.py): `-- name: x` headers and
the `{{now}}` clock. Kept apart so the dashboard's reads never mix with the queue's writes.
"""

from __future__ import annotations

from sqlalchemy import TextClause

from app.queue.sql import load_statements


def ui_q(name: str) -> TextClause:
    """The named dashboard statement, ready to execute."""
    return load_statements("app.ui")[name].clause
