"""Event streams and long polls: waking them when a run changes, deciding how often they look
again, and capping how many are open.

Waking: the LISTEN notifier reports the run status changes the queue notifies (waiting and
terminal transitions, deliveries, requeues); `RunWatch` wakes whoever waits on those runs.

Rechecking: claims and a running run's own events (tool calls, checkpoints) are not notified
(NOTIFY costs commit throughput), so a waiter also looks again on a timer, as rarely as that
allows (`recheck_seconds`): often only while something can change unnotified, that is while the
run is running or is queued and due (its claim is not notified); every `IDLE_RECHECK_SECONDS`
otherwise (a run waiting for the user, or queued for later), where notifications do the work
and the timer is only a safety net. An idle stream therefore costs the database about one
statement per half minute.

Live output: `LiveWatch` takes the deltas this process's notifier hears on the
`turnstile_deltas` channel (one listener per API process) and hands each to the inboxes of the
streams following its run or its session. An inbox is bounded: a stream that stops reading loses
deltas (the durable `message.completed` still comes), and never holds up the listener, the other
streams or any run.

Capping: each open stream or long poll holds a place (`StreamLimits`), at most
`max_streams_per_key` per API key and `max_streams_per_process` per API process; over either
cap the request is refused at once with 429 `too-many-streams` and `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from uuid import UUID

from app.api.problems import ApiProblem
from app.queue.deltas import Delta
from app.vocabulary.records import RUN_ID_PREFIX

STREAM_RECHECK_SECONDS = 0.5  # a running run's events reach its streams within this
POLL_RECHECK_SECONDS = 1.0  # a long poll's unnotified status changes (claims) within this
IDLE_RECHECK_SECONDS = 30.0  # a safety net only: these runs' next change is notified
RETRY_AFTER_SECONDS = 5


def recheck_seconds(status: str, scheduled_for: datetime | None, *, active_seconds: float) -> float:
    """How long a waiter on a run in `status` may sleep before it reads the run again, when no
    notification wakes it first."""
    if status == "running":
        return active_seconds
    if status == "queued":
        # Its claim is not notified: look often once it is due. The API process's clock only
        # paces this read; the queue's decisions keep using the database's time.
        due_in = (
            0.0 if scheduled_for is None else (scheduled_for - datetime.now(UTC)).total_seconds()
        )
        if due_in <= 0:
            return POLL_RECHECK_SECONDS
        return min(IDLE_RECHECK_SECONDS, max(active_seconds, due_in))
    return IDLE_RECHECK_SECONDS


class RunWatch:
    """Waiters keyed by the id prefix notifications name runs by (app/store/sql/runs.sql), so a
    notification wakes the waiters of the runs it names in time proportional to those names,
    not to every open stream."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}

    def notify(self, runs: set[str] | None) -> None:
        """Called by the notifier with the id prefixes a notification names; None means
        "anything may have changed" (after a reconnect, or a notification naming too many)."""
        prefixes = list(self._waiters) if runs is None else runs & self._waiters.keys()
        for prefix in prefixes:
            for event in self._waiters.get(prefix, ()):
                event.set()

    @contextlib.contextmanager
    def watching(self, run_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        prefix = run_id[:RUN_ID_PREFIX]
        self._waiters.setdefault(prefix, set()).add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(prefix)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[prefix]


INBOX_CAPACITY = 1_024  # deltas a stream may have unread before newer ones are dropped


class Inbox:
    """The deltas waiting for one stream, and a flag that wakes it."""

    def __init__(self, capacity: int = INBOX_CAPACITY) -> None:
        self.capacity = capacity
        self.ready = asyncio.Event()
        self.dropped = 0
        self.poked = False  # its session has a new run: look again now
        self._items: deque[Delta] = deque()

    def put(self, delta: Delta) -> None:
        if len(self._items) >= self.capacity:
            self.dropped += 1  # the stream is not reading: lose this one, hold nothing up
        else:
            self._items.append(delta)
        self.ready.set()

    def poke(self) -> None:
        """Wake the stream with no delta (its session has a new run)."""
        self.poked = True
        self.ready.set()

    def take(self) -> list[Delta]:
        self.ready.clear()
        items = list(self._items)
        self._items.clear()
        return items


class LiveWatch:
    """Inboxes of open streams by the run and by the session they follow."""

    def __init__(self) -> None:
        self._by_run: dict[UUID, set[Inbox]] = {}
        self._by_session: dict[UUID, set[Inbox]] = {}
        self.received = 0

    def deliver(self, deltas: list[Delta]) -> None:
        """Called by the notifier with one notification's deltas; never blocks."""
        self.received += len(deltas)
        for delta in deltas:
            for inbox in self._by_run.get(delta.run_id, ()):
                inbox.put(delta)
            if delta.session_id is not None:
                for inbox in self._by_session.get(delta.session_id, ()):
                    inbox.put(delta)

    def session_changed(self, session_id: UUID) -> None:
        """A turn was submitted here: the session's streams look again at once."""
        for inbox in self._by_session.get(session_id, ()):
            inbox.poke()

    def sessions_notified(self, prefixes: set[str] | None) -> None:
        """Called by the notifier: these sessions (by id prefix, as the queue names them; None:
        every one) got a new run, through whichever API process. A rare false match of a
        prefix only costs that stream a read."""
        for session_id, inboxes in list(self._by_session.items()):
            if prefixes is None or str(session_id)[:8] in prefixes:
                for inbox in inboxes:
                    inbox.poke()

    @contextlib.contextmanager
    def following(
        self, *, run_id: UUID | None = None, session_id: UUID | None = None
    ) -> Iterator[Inbox]:
        inbox = Inbox()
        keyed = [(self._by_run, run_id), (self._by_session, session_id)]
        for table, key in keyed:
            if key is not None:
                table.setdefault(key, set()).add(inbox)
        try:
            yield inbox
        finally:
            for table, key in keyed:
                if key is not None and key in table:
                    table[key].discard(inbox)
                    if not table[key]:
                        del table[key]


class StreamSlot:
    """One open stream's or long poll's place; releasing it twice is harmless."""

    def __init__(self, limits: StreamLimits, key_id: UUID) -> None:
        self._limits = limits
        self._key_id = key_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self._key_id)

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class StreamLimits:
    """Counts open streams and long polls per key and in this process (the event loop is the
    only thread that touches the counts, so they need no lock)."""

    def __init__(self, *, per_key: int, per_process: int) -> None:
        self.per_key = per_key
        self.per_process = per_process
        self.open = 0
        self._by_key: dict[UUID, int] = {}

    def acquire(self, key_id: UUID) -> StreamSlot:
        """A place for one more stream or long poll of `key_id`, or 429 `too-many-streams`."""
        held = self._by_key.get(key_id, 0)
        if held >= self.per_key:
            raise _too_many(f"this key already has {held} open (per key limit {self.per_key})")
        if self.open >= self.per_process:
            raise _too_many(
                f"this API process already serves {self.open} (process limit {self.per_process})"
            )
        self._by_key[key_id] = held + 1
        self.open += 1
        return StreamSlot(self, key_id)

    def _release(self, key_id: UUID) -> None:
        self.open -= 1
        left = self._by_key.get(key_id, 1) - 1
        if left > 0:
            self._by_key[key_id] = left
        else:
            self._by_key.pop(key_id, None)


def _too_many(why: str) -> ApiProblem:
    return ApiProblem(
        "too-many-streams",
        f"too many open event streams and long polls: {why}; close one or retry later",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


async def wait_for_change(
    event: asyncio.Event, shutdown: asyncio.Event, seconds: float, *more: asyncio.Event
) -> None:
    """Return when `event`, `shutdown` or any of `more` is set, or after `seconds`."""
    waiters = [asyncio.ensure_future(e.wait()) for e in (event, shutdown, *more)]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
