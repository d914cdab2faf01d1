"""Checks of a run's log that must hold whatever happened to it: the ADR's race gate in code.

- Event sequence numbers are 1..last_event_seq with no gap.
- In sequence order, the epochs of events never go backwards, `run.fenced` aside (it carries
  the stale epoch of the worker that lost the run); only a claim or a cancellation starts a
  new epoch, and every other event carries the epoch of the claim before it, so committed
  writes come from one lease holder at a time.
- Every checkpoint and journal row points at an event of its own transaction with the same
  epoch, so their epochs never go backwards either.
- At most one terminal event, and after it nothing but `run.fenced` and `operator.*` notes
  (dismiss, resubmit), which are not transitions.
- No `run.fenced` for an epoch whose holder had already ended its hold itself (succeeded,
  failed, asked the user, released): such a record is spurious, the holder lost nothing.
- Replaying the transition events gives a valid path through the statuses that ends at the
  run's status; a run is `queued` again only through the four requeue paths; tool records,
  checkpoints and notes appear only while the run is running.

And one check of the whole queue (`check_tenant_counts`, part of `check_all_runs`): every
tenant's counts per class hold exactly its running and queued runs (docs/adr/0006): no
drift between tenant_class_counts (with its stripes, tenant_queued_stripes) and the runs the
statements moved, and has_work set wherever runs are queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

TERMINAL_EVENTS = {"run.succeeded", "run.failed", "run.cancelled"}
# The only events that start a new epoch: a claim (the fencing token of a new owner) and a
# cancellation (which fences whoever held the run).
EPOCH_BUMPS = {"run.claimed", "run.cancelled"}
# Which status each transition event may leave, and which status it leads to. A run is queued
# again only through creation and the four requeue paths (requeued, released, delivered).
TRANSITIONS: dict[str, tuple[set[str | None], str]] = {
    "run.created": ({None}, "queued"),
    "run.claimed": ({"queued"}, "running"),
    "run.requeued": ({"running"}, "queued"),
    "run.released": ({"running"}, "queued"),
    "run.waiting": ({"running"}, "waiting_for_user"),
    "run.input_delivered": ({"waiting_for_user"}, "queued"),
    "run.succeeded": ({"running"}, "succeeded"),
    "run.failed": ({"running"}, "failed"),
    "run.cancelled": ({"queued", "running", "waiting_for_user"}, "cancelled"),
}


@dataclass
class RunLog:
    run_id: UUID
    status: str
    last_event_seq: int
    events: list[tuple[int, str, int]]  # (seq, type, epoch)
    checkpoints: list[tuple[int, int]]  # (event_seq, epoch)
    journal: list[tuple[int, int]]
    # Epochs whose holder ended its own hold, with the sequence of that event (the sweeper's
    # run.failed and run.requeued are not the holder's).
    holder_endings: dict[int, int] | None = None


async def read_log(conn: AsyncConnection, run_id: UUID) -> RunLog:
    run = (
        await conn.execute(
            text("SELECT status, last_event_seq FROM runs WHERE id = :id"), {"id": run_id}
        )
    ).one()
    events = (
        await conn.execute(
            text("SELECT seq, type, epoch FROM run_events WHERE run_id = :id ORDER BY seq"),
            {"id": run_id},
        )
    ).all()
    checkpoints = (
        await conn.execute(
            text("SELECT event_seq, epoch FROM checkpoints WHERE run_id = :id ORDER BY event_seq"),
            {"id": run_id},
        )
    ).all()
    journal = (
        await conn.execute(
            text("SELECT event_seq, epoch FROM tool_journal WHERE run_id = :id ORDER BY event_seq"),
            {"id": run_id},
        )
    ).all()
    endings = (
        await conn.execute(
            text(
                "SELECT epoch, min(seq) FROM run_events WHERE run_id = :id AND (type IN "
                "('run.succeeded', 'run.waiting', 'run.released') OR (type = 'run.failed' "
                "AND data->'failure'->>'kind' IS DISTINCT FROM 'lease_expired')) GROUP BY epoch"
            ),
            {"id": run_id},
        )
    ).all()
    return RunLog(
        holder_endings={int(epoch): int(seq) for epoch, seq in endings},
        run_id=run_id,
        status=run.status,
        last_event_seq=run.last_event_seq,
        events=[(e.seq, e.type, e.epoch) for e in events],
        checkpoints=[(c.event_seq, c.epoch) for c in checkpoints],
        journal=[(j.event_seq, j.epoch) for j in journal],
    )


def settled_by_cancel(types: list[str]) -> bool:
    """Whether these events (from a tool.finished on) are a cancel's settling of the calls it
    left open: tool.finished events, then run.cancelled (runs.sql's cancel_runs)."""
    rest = list(types)
    while rest and rest[0] == "tool.finished":
        rest.pop(0)
    return bool(rest) and rest[0] == "run.cancelled"


def check_log(log: RunLog) -> None:
    seqs = [seq for seq, _, _ in log.events]
    assert seqs == list(range(1, log.last_event_seq + 1)), f"{log.run_id}: gaps in {seqs}"

    highest = 0
    terminal_seen = False
    by_seq = {seq: (type_, epoch) for seq, type_, epoch in log.events}
    for seq, type_, epoch in log.events:
        if type_ == "run.fenced" or type_.startswith("operator."):
            continue  # a stale worker's record, or an operator's note on a finished run
        assert not terminal_seen, f"{log.run_id}: {type_} at {seq} after a terminal event"
        if type_ in EPOCH_BUMPS:
            assert epoch > highest, f"{log.run_id}: {type_} at {seq} did not take a new epoch"
        else:
            # One epoch at a time: every write between two claims belongs to the earlier one.
            assert epoch == highest, (
                f"{log.run_id}: {type_} at {seq} in epoch {epoch}, not {highest}"
            )
        highest = epoch
        terminal_seen = type_ in TERMINAL_EVENTS

    for seq, type_, epoch in log.events:
        ended_at = (log.holder_endings or {}).get(epoch)
        if type_ == "run.fenced" and ended_at is not None:
            assert seq < ended_at, (
                f"{log.run_id}: spurious run.fenced at {seq}: epoch {epoch} had ended its own "
                f"hold at {ended_at}"
            )

    for kind, rows in (("checkpoint", log.checkpoints), ("journal", log.journal)):
        for event_seq, epoch in rows:
            assert event_seq in by_seq, f"{log.run_id}: {kind} at {event_seq} has no event"
            event_type, event_epoch = by_seq[event_seq]
            assert event_type != "run.fenced", f"{log.run_id}: {kind} written by a fenced epoch"
            assert event_epoch == epoch, f"{log.run_id}: {kind} epoch {epoch} != {event_epoch}"

    status: str | None = None
    types = [type_ for _, type_, _ in log.events]
    for index, (seq, type_, _) in enumerate(log.events):
        if type_ == "run.input_delivered" and status == "running":
            continue  # a steered input (docs/turn-control.md): taken by the run, no transition
        if type_ in TRANSITIONS:
            sources, target = TRANSITIONS[type_]
            assert status in sources, f"{log.run_id}: {type_} at {seq} from status {status}"
            status = target
        elif type_ == "tool.finished" and settled_by_cancel(types[index:]):
            pass  # a cancel settles the open calls it leaves, whatever the run's status
        elif type_.startswith("turn.") or type_ in (
            "run.interrupted",
            "tool.approved",
            "tool.rejected",
        ):
            # Notes about a session's other turns (docs/turn-control.md) and a user's decision
            # on a tool call (docs/approvals.md), not worker writes: written while the run is
            # active, whatever its status.
            assert status in ("queued", "running", "waiting_for_user"), (
                f"{log.run_id}: {type_} at {seq} while {status}"
            )
        elif type_ != "run.fenced" and not type_.startswith("operator."):
            # Tool records, checkpoints and agent notes are worker writes: only while running.
            assert status == "running", f"{log.run_id}: {type_} at {seq} while {status}"
    assert status == log.status, f"{log.run_id}: log ends {status}, row says {log.status}"

    terminal = [t for _, t, _ in log.events if t in TERMINAL_EVENTS]
    assert len(terminal) <= 1, f"{log.run_id}: terminal events {terminal}"
    if log.status in ("succeeded", "failed", "cancelled"):
        assert terminal == [f"run.{log.status}"], f"{log.run_id}: {log.status} but {terminal}"


# The running runs of each (tenant, band) beside its count row, wherever the two disagree.
RUNNING_DRIFT = """
SELECT coalesce(c.tenant_id, r.tenant_id) AS tenant_id, coalesce(c.band, r.band) AS band,
       c.running AS counted_running, coalesce(r.running, 0) AS running
FROM tenant_class_counts c
FULL JOIN (
    SELECT tenant_id, priority / 10 AS band, count(*) AS running
    FROM runs WHERE status = 'running'
    GROUP BY tenant_id, priority / 10
) r ON r.tenant_id = c.tenant_id AND r.band = c.band
WHERE coalesce(c.running, 0) <> coalesce(r.running, 0)
"""

# Queued runs the fair walk could miss for good (a lost wakeup; docs/adr/0009): their pair is
# neither marked as having work nor due by their time (or has no count row at all).
HIDDEN_WORK = """
SELECT r.id, r.tenant_id, r.priority / 10 AS band, coalesce(r.scheduled_for, r.created_at) AS at,
       c.has_work, c.due_at
FROM runs r
LEFT JOIN tenant_class_counts c ON c.tenant_id = r.tenant_id AND c.band = r.priority / 10
WHERE r.status = 'queued'
  AND NOT coalesce(c.has_work, false)
  AND (c.due_at IS NULL OR c.due_at > coalesce(r.scheduled_for, r.created_at))
"""


async def check_tenant_counts(conn: AsyncConnection) -> None:
    """No drift: each tenant's running count per class equals its running runs, and every
    queued run's pair is in the fair walk or due by the run's time."""
    drift = (await conn.execute(text(RUNNING_DRIFT))).mappings().all()
    assert not drift, f"tenant_class_counts drifted from the runs: {[dict(d) for d in drift]}"
    hidden = (await conn.execute(text(HIDDEN_WORK))).mappings().all()
    assert not hidden, f"queued runs the fair walk cannot find: {[dict(h) for h in hidden]}"


async def check_all_runs(engine: AsyncEngine, *, counts: bool = True) -> int:
    """Check every run's log and (unless `counts` is false: a schema of another release) the
    tenants' counts; returns how many runs were checked."""
    async with engine.connect() as conn:
        ids = (await conn.execute(text("SELECT id FROM runs"))).scalars().all()
        for run_id in ids:
            check_log(await read_log(conn, run_id))
        if counts:
            await check_tenant_counts(conn)
    return len(ids)
