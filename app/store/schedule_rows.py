"""The schedules' rows (app/store/sql/schedules.sql): schedules created, locked, paused, resumed
and deleted, their ticks made and read, their pages and figures. A schedule's rules (one run
per tick, the next fire time, the holdings) are app/queue/scheduling.py's; it opens the
transactions its operations need (app/store/transactions.py) and runs each statement of
schedules.sql through `rows` on them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store.statements import q, statements

SOURCE = "app/store/sql/schedules.sql"


@cache
def schedule_statements() -> frozenset[str]:
    """The names of schedules.sql's statements: the only ones `rows` sends."""
    return frozenset(name for name, s in statements().items() if s.source == SOURCE)


async def rows(conn: AsyncConnection, name: str, params: dict[str, Any]) -> list[RowMapping]:
    """The rows of schedules.sql's statement `name` on the caller's transaction."""
    if name not in schedule_statements():
        raise ValueError(f"{name} is not a statement of {SOURCE}")
    return list((await conn.execute(q(name), params)).mappings().all())
