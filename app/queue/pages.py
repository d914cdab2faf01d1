"""Keyset pages of runs: the opaque cursor (the last run's ordering time and id) and the one
fetch that reads a page plus one row, the extra row only saying whether a next page exists.
Used by the runbook reads (app/queue/reads.py) for the API and the dashboard alike. A session's
transcript pages the same way, on its own cursor: the last entry's (run number, seq)."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.errors import InvalidCursorError
from app.store.read_rows import page_rows
from app.vocabulary.records import Run, TranscriptEntry

# The keyset statements name their "before" parameter after the column they are ordered by.
BEFORE_PARAMETER = {
    "created_at": "before_created",
    "finished_at": "before_finished",
    "fire_at": "before_fire",
}


def encode_cursor(created_at: datetime, run_id: UUID) -> str:
    raw = f"{created_at.isoformat()}|{run_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        when, _, run_id = base64.urlsafe_b64decode(padded).decode().partition("|")
        moment = datetime.fromisoformat(when)
        if moment.tzinfo is None:
            raise ValueError("naive time in cursor")
        return moment.astimezone(UTC), UUID(run_id)
    except (ValueError, UnicodeDecodeError, OverflowError):
        raise InvalidCursorError() from None


@dataclass(frozen=True)
class RunsPage:
    runs: list[Run]
    next_cursor: str | None  # None on the last page


async def runs_page(
    engine: AsyncEngine,
    statement: str,
    params: dict[str, Any],
    *,
    cursor: str | None,
    limit: int,
    order_field: str,
) -> RunsPage:
    """Up to `limit` runs of the keyset statement `statement` ordered by (`order_field`, id)
    descending, after `cursor`; the next cursor is the last run's (`order_field`, id)."""
    before = decode_cursor(cursor) if cursor else (None, None)
    rows = await page_rows(
        engine,
        statement,
        {
            **params,
            BEFORE_PARAMETER[order_field]: before[0],
            "before_id": before[1],
            "limit": limit + 1,
        },
    )
    runs = [Run.from_row(row) for row in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        when = getattr(runs[-1], order_field)
        if when is not None:
            next_cursor = encode_cursor(when, runs[-1].id)
    return RunsPage(runs, next_cursor)


def encode_transcript_cursor(run_no: int, seq: int) -> str:
    return base64.urlsafe_b64encode(f"t|{run_no}|{seq}".encode()).decode().rstrip("=")


# ASCII digits within the columns' ranges (session_run_no is an integer, seq a bigint): int()
# alone also takes '1_0', other scripts' digits (U+0661) and numbers the statement's casts
# would refuse.
_TRANSCRIPT_CURSOR = re.compile(r"t\|([0-9]{1,10})\|([0-9]{1,19})", re.ASCII)
MAX_RUN_NO = 2**31 - 1
MAX_SEQ = 2**63 - 1


def decode_transcript_cursor(cursor: str) -> tuple[int, int]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        found = _TRANSCRIPT_CURSOR.fullmatch(base64.urlsafe_b64decode(padded).decode())
    except (ValueError, UnicodeDecodeError):
        raise InvalidCursorError() from None
    if found is None:
        raise InvalidCursorError()
    run_no, seq = int(found.group(1)), int(found.group(2))
    if run_no > MAX_RUN_NO or seq > MAX_SEQ:
        raise InvalidCursorError()
    return run_no, seq


@dataclass(frozen=True)
class TranscriptPage:
    entries: list[TranscriptEntry]
    next_cursor: str | None  # None on the last page


async def transcript_page(
    engine: AsyncEngine, session_id: UUID, *, cursor: str | None, limit: int
) -> TranscriptPage:
    """Up to `limit` entries of a session's transcript after `cursor`, oldest first."""
    after = decode_transcript_cursor(cursor) if cursor else (0, 0)
    rows = await page_rows(
        engine,
        "session_transcript",
        {
            "session_id": session_id,
            "after_run_no": after[0],
            "after_seq": after[1],
            "from_run_no": 1,
            "through_run_no": None,
            "limit": limit + 1,
        },
    )
    entries = [TranscriptEntry.from_row(row) for row in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        next_cursor = encode_transcript_cursor(entries[-1].run_no, entries[-1].seq)
    return TranscriptPage(entries, next_cursor)
