"""Waking long polls and event streams when a run changes, without a tight database loop.

The LISTEN notifier reports run status changes that the queue notifies (waiting and terminal
transitions, deliveries); `RunWatch` wakes whoever waits on those runs. Other changes (a claim,
a tool call) are not notified, so waiters also look again at a coarse interval.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from app.queue.models import RUN_ID_PREFIX


class RunWatch:
    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}

    def notify(self, runs: set[str] | None) -> None:
        """Called by the notifier with the id prefixes a notification names; None means
        "anything may have changed" (after a reconnect, or a notification naming too many)."""
        targets = (
            self._waiters.keys()
            if runs is None
            else [run_id for run_id in self._waiters if run_id[:RUN_ID_PREFIX] in runs]
        )
        for run_id in list(targets):
            for event in self._waiters.get(run_id, ()):
                event.set()

    @contextlib.contextmanager
    def watching(self, run_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._waiters.setdefault(run_id, set()).add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(run_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[run_id]


async def wait_for_change(event: asyncio.Event, shutdown: asyncio.Event, seconds: float) -> None:
    """Return when `event` or `shutdown` is set, or after `seconds`."""
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(shutdown.wait())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
