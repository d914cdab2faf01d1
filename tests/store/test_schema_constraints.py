"""Schema rules that hold whatever code writes: one active run per session (ADR-0004 decision
10), sessionless runs unconstrained, and the CHECKs on statuses and class bands."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

# A run of a session carries its number within the session (ck_runs_session_run_no).
INSERT_RUN = text(
    "INSERT INTO runs (tenant_id, principal, session_id, session_run_no, agent, input, priority) "
    "VALUES ('t', 'p', :session_id, CASE WHEN CAST(:session_id AS uuid) IS NOT NULL THEN "
    "(SELECT count(*) + 1 FROM runs WHERE session_id = :session_id) END, "
    "'scripted', '{}'::jsonb, :priority) RETURNING id"
)


async def _session(conn: AsyncConnection) -> uuid.UUID:
    sid = await conn.scalar(
        text("INSERT INTO sessions (tenant_id, principal) VALUES ('t', 'p') RETURNING id")
    )
    assert isinstance(sid, uuid.UUID)
    return sid


async def _insert(conn: AsyncConnection, session_id: uuid.UUID | None, priority: int = 0) -> None:
    await conn.execute(INSERT_RUN, {"session_id": session_id, "priority": priority})


async def test_second_active_run_in_a_session_is_rejected(db_conn: AsyncConnection) -> None:
    sid = await _session(db_conn)
    await _insert(db_conn, sid)
    savepoint = await db_conn.begin_nested()
    with pytest.raises(IntegrityError, match="uq_runs_session_id_active"):
        await _insert(db_conn, sid)
    await savepoint.rollback()


@pytest.mark.parametrize("active", ["running", "waiting_for_user"])
async def test_every_non_terminal_status_holds_the_slot(
    db_conn: AsyncConnection, active: str
) -> None:
    sid = await _session(db_conn)
    await _insert(db_conn, sid)
    extra = {
        "running": ", lease_owner = 'w', lease_expires_at = now()",
        "waiting_for_user": ", question = '\"q\"'::jsonb",
    }[active]
    await db_conn.execute(
        text(f"UPDATE runs SET status = :s{extra} WHERE session_id = :sid"),
        {"s": active, "sid": sid},
    )
    savepoint = await db_conn.begin_nested()
    with pytest.raises(IntegrityError, match="uq_runs_session_id_active"):
        await _insert(db_conn, sid)
    await savepoint.rollback()


@pytest.mark.parametrize("terminal", ["succeeded", "failed", "cancelled"])
async def test_a_new_run_is_accepted_after_the_first_ends(
    db_conn: AsyncConnection, terminal: str
) -> None:
    sid = await _session(db_conn)
    await _insert(db_conn, sid)
    await db_conn.execute(
        text(
            "UPDATE runs SET status = :s, finished_at = now(), "
            "failure = CASE WHEN :s = 'failed' THEN '{}'::jsonb END WHERE session_id = :sid"
        ),
        {"s": terminal, "sid": sid},
    )
    await _insert(db_conn, sid)
    count = await db_conn.scalar(
        text("SELECT count(*) FROM runs WHERE session_id = :sid"), {"sid": sid}
    )
    assert count == 2


async def test_many_sessionless_runs_are_accepted(db_conn: AsyncConnection) -> None:
    for _ in range(5):
        await _insert(db_conn, None)
    count = await db_conn.scalar(text("SELECT count(*) FROM runs WHERE session_id IS NULL"))
    assert count == 5


@pytest.mark.parametrize(
    ("priority", "ok"), [(0, True), (9, True), (15, True), (29, True), (30, False), (-1, False)]
)
async def test_priority_is_a_band_range(db_conn: AsyncConnection, priority: int, ok: bool) -> None:
    savepoint = await db_conn.begin_nested()
    if ok:
        await _insert(db_conn, None, priority)
        await savepoint.commit()
    else:
        with pytest.raises(IntegrityError, match="ck_runs_priority_band"):
            await _insert(db_conn, None, priority)
        await savepoint.rollback()


async def test_unknown_status_and_lease_outside_running_are_rejected(
    db_conn: AsyncConnection,
) -> None:
    await _insert(db_conn, None)
    for statement, constraint in [
        ("UPDATE runs SET status = 'paused'", "ck_runs_status"),
        (
            "UPDATE runs SET lease_owner = 'w', lease_expires_at = now()",
            "ck_runs_lease_only_when_running",
        ),
        ("UPDATE runs SET status = 'failed', finished_at = now()", "ck_runs_failed_has_failure"),
    ]:
        savepoint = await db_conn.begin_nested()
        with pytest.raises(IntegrityError, match=constraint):
            await db_conn.execute(text(statement))
        await savepoint.rollback()
