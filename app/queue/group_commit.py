"""Group commit: callers' items that arrive while a statement is in flight wait for it, then
go together in the next one (docs/adr/0012-group-committed-submissions.md; the worker's
completions and the API's submissions use it).

An item that arrives with a flusher's place free starts a flusher at once: nothing waits on a
timer. A flusher takes up to `max_batch` items (leaving out those whose callers were
cancelled) and hands them to `send`, which answers each item's future, then takes the next
until none is left. Up to `max_in_flight` flushers run at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class GroupCommit(Generic[Item, Answer]):
    """`put(item)` answers with what `send` set on the item's future."""

    def __init__(
        self,
        send: Callable[[list[tuple[Item, asyncio.Future[Answer]]]], Awaitable[None]],
        *,
        max_batch: int,
        max_in_flight: int = 1,
        name: str,
    ) -> None:
        self.send = send
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.name = name
        self._pending: list[tuple[Item, asyncio.Future[Answer]]] = []
        self._flushers: set[asyncio.Task[None]] = set()

    async def put(self, item: Item) -> Answer:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        # A flusher that has returned is done at once, but leaves the set only when its
        # done-callback runs: counted until then, a caller it had just answered and that sent
        # its next item at once would find no place and wait for someone else's item.
        if sum(not flusher.done() for flusher in self._flushers) < self.max_in_flight:
            flusher = asyncio.create_task(self._flush(), name=self.name)
            self._flushers.add(flusher)
            flusher.add_done_callback(self._flushers.discard)
        return await future

    async def _flush(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Answer]]] = []
        try:
            while self._pending:
                taken = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                batch = [item for item in taken if not item[1].done()]  # cancelled callers
                if batch:
                    await self.send(batch)
                batch = []
        except BaseException:
            # The flusher itself was cancelled (the loop is going away): no caller may wait on
            # an answer that will never come. What it had taken is cancelled; what is still
            # pending is another flusher's to send, or, with none left, cancelled too.
            for _, future in batch:
                future.cancel()
            current = asyncio.current_task()
            if not any(not f.done() for f in self._flushers if f is not current):
                for _, future in self._pending:
                    future.cancel()
                self._pending.clear()
            raise


def fail(futures: list[asyncio.Future[Answer]], exc: BaseException) -> None:
    """Each caller still waiting gets `exc`."""
    for future in futures:
        if not future.done():
            future.set_exception(exc)
