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
from app.vocabulary.records import JSON, Lease, WriteOutcome

_Pending = tuple[Lease, JSON, "asyncio.Future[WriteOutcome]"]


MAX_BATCH = 256
"""The largest completion batch one statement carries (its NOTIFY is bounded whatever the size)."""


class CompletionBatcher:
    def __init__(self, queue: Queue, *, max_batch: int = MAX_BATCH) -> None:
        self.queue = queue
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self.statements = 0  # complete_many statements sent (tests and the benchmark read it)

    async def complete(self, lease: Lease, result: JSON) -> WriteOutcome:
        """Complete the run under `lease` with the next batch; `Fenced` when its fence failed."""
        future: asyncio.Future[WriteOutcome] = asyncio.get_running_loop().create_future()
        self._pending.append((lease, result, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="turnstile-completions")
        return await future

    async def _flush(self) -> None:
        batch: list[_Pending] = []
        try:
            while self._pending:
                taken = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                batch = [item for item in taken if not item[2].done()]  # cancelled callers
                if not batch:
                    continue
                try:
                    outcomes = await self.queue.complete_many(
                        [(lease, result) for lease, result, _ in batch]
                    )
                except Exception as exc:
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                finally:
                    self.statements += 1
                for (_, _, future), outcome in zip(batch, outcomes, strict=True):
                    if not future.done():
                        future.set_result(outcome)
                batch = []
        except BaseException:
            # The flusher itself was cancelled (the loop is going away): no caller may wait on
            # a batch that will never be sent, or on an answer that will never be read.
            for _, _, future in [*batch, *self._pending]:
                future.cancel()
            self._pending.clear()
            raise
