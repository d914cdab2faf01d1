"""ADR-0004's hard gate: workers racing on one run while the sweeper reclaims continuously end
with exactly one epoch committing each transition, and every other epoch writing nothing but
its `run.fenced` event.

Each round enqueues one run. Three workers (each transaction on its own pooled connection)
claim it, write a tool journal entry, its outcome with a checkpoint, an event, and complete it,
with leases of a few milliseconds, while a sweeper running back to back (interval 0, no
backoff) requeues the run whenever its lease lapses. A worker whose write comes back fenced
records `run.fenced` and goes back to claiming. `max_attempts` is raised so the run is never
dead-lettered. After each round: one `run.succeeded`; every write a worker saw committed is in
the log with its epoch; the log's invariants hold (tests/support/invariants.py).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from uuid import UUID

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.sweeper import Sweeper
from app.queue.core import Queue, QueueConfig
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, ToolCall, WriteOutcome, Written
from tests.support.invariants import check_log, read_log

ROUNDS = int(os.environ.get("TURNSTILE_RACE_ROUNDS", "200"))
WORKERS = 3
STALL_CHANCE = 0.15  # before each write, a worker stalls past its lease this often
rng = random.Random(4)


@dataclass
class Tally:
    committed: list[tuple[UUID, int, int, str]] = field(default_factory=list)  # run, epoch, seq
    fenced: Counter[str] = field(default_factory=Counter)
    claims: int = 0


async def _work(queue: Queue, name: str, run_id: UUID, done: asyncio.Event, tally: Tally) -> None:
    while not done.is_set():
        claimed = await queue.claim(name, list(PriorityClass))
        if not claimed:
            continue
        tally.claims += 1
        lease: Lease = claimed[0].lease
        assert lease.run_id == run_id
        call = ToolCall(step=1, tool="echo", idempotency_class="safe", args={"w": name})
        steps: list[tuple[str, Callable[[], Awaitable[WriteOutcome]]]] = [
            ("tool_started", partial(queue.tool_started, lease, call)),
            ("tool_finished", partial(queue.tool_finished, lease, call, "succeeded", {}, {})),
            ("append_event", partial(queue.append_event, lease, "agent.note", {"w": name})),
            ("complete", partial(queue.complete, lease, {"winner": name, "epoch": lease.epoch})),
        ]
        for label, write in steps:
            # A worker stalled past its lease (a long GC pause, a descheduled process) resumes
            # after the sweeper has taken its run back: its next write must come back fenced.
            # Waiting for that on the run's row, not on a timer, makes the race happen in every
            # environment: on a fast machine the writes would otherwise outrun a short lease.
            if rng.random() < STALL_CHANCE:
                await _stalled_until_reclaimed(queue, lease)
            # Heartbeat before some writes only, so fences are met by writes as well as beats.
            if rng.random() < 0.4 and not await queue.heartbeat(lease):
                await queue.record_fenced(lease, during="heartbeat")
                tally.fenced["heartbeat"] += 1
                break
            outcome = await write()
            if isinstance(outcome, Fenced):
                await queue.record_fenced(lease, during=label)
                tally.fenced[label] += 1
                break
            assert isinstance(outcome, Written)
            tally.committed.append((run_id, lease.epoch, outcome.seq, label))
        else:
            done.set()


async def _stalled_until_reclaimed(queue: Queue, lease: Lease) -> None:
    """Until the run is no longer held under this lease (requeued by the sweeper, maybe claimed
    again), read from its row."""
    async with queue.engine.connect() as conn:
        for _ in range(5_000):
            row = (
                await conn.execute(
                    text("SELECT status, lease_epoch FROM runs WHERE id = :id"),
                    {"id": lease.run_id},
                )
            ).one()
            await conn.commit()  # a fresh snapshot for the next read
            if row.status != "running" or row.lease_epoch != lease.epoch:
                return
            await asyncio.sleep(0.001)
    raise AssertionError("the sweeper never took back a lapsed lease")


async def test_racing_workers_commit_each_transition_once(engine: AsyncEngine) -> None:
    config = QueueConfig(
        lease_seconds=0.002, max_attempts=1_000_000, backoff_base_seconds=0, backoff_max_seconds=0
    )
    queue = Queue(engine, config)
    sweeper = Sweeper(queue, holder="test", interval=0)
    sweeping = asyncio.create_task(sweeper.run())
    tally = Tally()
    epochs_per_run: list[int] = []
    try:
        for _ in range(ROUNDS):
            run = await queue.enqueue(
                NewRun(tenant_id="t", principal="p", agent="scripted", input={})
            )
            done = asyncio.Event()
            await asyncio.wait_for(
                asyncio.gather(
                    *(_work(queue, f"w{i}", run.id, done, tally) for i in range(WORKERS))
                ),
                timeout=60,
            )
            async with engine.connect() as conn:
                log = await read_log(conn, run.id)
            check_log(log)
            assert log.status == "succeeded"
            assert [t for _, t, _ in log.events].count("run.succeeded") == 1
            events = {seq: (type_, epoch) for seq, type_, epoch in log.events}
            kinds = {
                "tool_started": "tool.started",
                "tool_finished": "tool.finished",
                "append_event": "agent.note",
                "complete": "run.succeeded",
            }
            for run_id, epoch, seq, label in tally.committed:
                if run_id == run.id:
                    assert events[seq] == (kinds[label], epoch)
            epochs_per_run.append(max(epoch for _, _, epoch in log.events))
    finally:
        await sweeper.stop()
        await sweeping

    # The gate only means something if the race really happened, often.
    total_fenced = sum(tally.fenced.values())
    print(
        f"\nrace gate: {ROUNDS} rounds, {tally.claims} claims, fenced {dict(tally.fenced)}, "
        f"max epochs in a round {max(epochs_per_run)}"
    )
    assert total_fenced >= ROUNDS // 4
    assert sum(1 for e in epochs_per_run if e > 1) >= ROUNDS // 4
