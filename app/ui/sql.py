"""Loads the dashboard's named statements (`app/ui/queries.sql`) once, at first use.

Same format and parser as the queue's statements (app/queue/sql.py): `-- name: x` headers and
the `{{now}}` clock. Kept apart so the dashboard's reads never mix with the queue's writes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from sqlalchemy import TextClause

from app.queue.sql import Statement, parse


@cache
def statements() -> dict[str, Statement]:
    source = resources.files("app.ui").joinpath("queries.sql").read_text(encoding="utf-8")
    return parse(source)


def ui_q(name: str) -> TextClause:
    """The named dashboard statement, ready to execute."""
    return statements()[name].clause
