"""Group commit of completions for one slot group.

A run's completion is one fenced statement and one commit; a commit is what PostgreSQL's
throughput is counted in (bench/ceiling.py), and short runs finish in bursts. So the runs of a
slot group that finish while a completion is being committed wait for it, then go together in
the next `complete_many` statement: one transaction, one WAL flush, one NOTIFY for all of them.
A run that finishes alone is committed at once; nothing waits on a timer.

Every run in a batch is still fenced on its own lease (see `complete_many` in
app/store/sql/runs.sql): the statement writes only the runs whose fence matches and its
caller gets `Fenced` for the others. A caller cancelled before its batch is sent is left out
of it and writes nothing.
"""

from __future__ import annotations

import asyncio

from app.queue.core import Queue
from app.queue.group_commit import GroupCommit, fail
from app.vocabulary.records import JSON, Lease, WriteOutcome

MAX_BATCH = 256
"""The largest completion batch one statement carries (its NOTIFY is bounded whatever the size)."""


class CompletionBatcher:
    def __init__(self, queue: Queue, *, max_batch: int = MAX_BATCH) -> None:
        self.queue = queue
        # One flusher: the slot group's completions go in one statement after another.
        self._group: GroupCommit[tuple[Lease, JSON], WriteOutcome] = GroupCommit(
            self._send, max_batch=max_batch, name="turnstile-completions"
        )
        self.statements = 0  # complete_many statements sent (tests and the benchmark read it)

    async def complete(self, lease: Lease, result: JSON) -> WriteOutcome:
        """Complete the run under `lease` with the next batch; `Fenced` when its fence failed."""
        return await self._group.put((lease, result))

    async def _send(
        self, batch: list[tuple[tuple[Lease, JSON], asyncio.Future[WriteOutcome]]]
    ) -> None:
        self.statements += 1
        try:
            outcomes = await self.queue.complete_many([item for item, _ in batch])
        except Exception as exc:
            fail([future for _, future in batch], exc)
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)
