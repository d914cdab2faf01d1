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
`max_streams_per_key` per API key, `max_streams_per_tenant` per tenant (all its keys) and
`max_streams_per_process` per API process; over any cap the request is refused at once with 429
`too-many-streams` and `Retry-After`.

Revocation: a place remembers its key. `KeyRecheck` asks the database every
`stream_key_recheck_seconds` which of the keys holding places are still unrevoked (one
statement for all of them, none while nothing is open) and ends the places of the others: a
stream sends `stream.ended` (`reason: key-revoked`) and closes, a long poll answers 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from uuid import UUID

from app.api.problems import ApiProblem
from app.vocabulary.live_deltas import Delta
from app.vocabulary.records import RUN_ID_PREFIX

log = logging.getLogger("turnstile.api")

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


KEY_REVOKED = "key-revoked"
"""Why a place was ended: its key was revoked while the stream or long poll was open."""


class StreamSlot:
    """One open stream's or long poll's place; releasing it twice is harmless. `ended` is set
    (with `reason`) when the stream must end early: its key was revoked."""

    def __init__(self, limits: StreamLimits, key_id: UUID, tenant_id: str) -> None:
        self._limits = limits
        self.key_id = key_id
        self.tenant_id = tenant_id
        self.ended = asyncio.Event()
        self.reason: str | None = None
        self._held = True

    def end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self)

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class StreamLimits:
    """Counts open streams and long polls per key, per tenant and in this process, and knows
    each key's places (the event loop is the only thread that touches them: no lock)."""

    def __init__(self, *, per_key: int, per_tenant: int, per_process: int) -> None:
        self.per_key = per_key
        self.per_tenant = per_tenant
        self.per_process = per_process
        self.open = 0
        self._by_key: dict[UUID, set[StreamSlot]] = {}
        self._by_tenant: dict[str, int] = {}

    def acquire(self, key_id: UUID, tenant_id: str) -> StreamSlot:
        """A place for one more stream or long poll of `key_id` (of `tenant_id`), or 429
        `too-many-streams` naming the limit that is full."""
        held = len(self._by_key.get(key_id, ()))
        if held >= self.per_key:
            raise _too_many(f"this key already has {held} open (per key limit {self.per_key})")
        tenant_held = self._by_tenant.get(tenant_id, 0)
        if tenant_held >= self.per_tenant:
            raise _too_many(
                f"this key's tenant already has {tenant_held} open in this API process (per "
                f"tenant limit {self.per_tenant})"
            )
        if self.open >= self.per_process:
            raise _too_many(
                f"this API process already serves {self.open} (process limit {self.per_process})"
            )
        slot = StreamSlot(self, key_id, tenant_id)
        self._by_key.setdefault(key_id, set()).add(slot)
        self._by_tenant[tenant_id] = tenant_held + 1
        self.open += 1
        return slot

    def held_keys(self) -> set[UUID]:
        """The keys holding at least one place now."""
        return set(self._by_key)

    def end_for(self, key_ids: set[UUID], reason: str) -> int:
        """End every place these keys hold (each stream sees `ended` and stops); how many."""
        ended = 0
        for key_id in key_ids:
            for slot in self._by_key.get(key_id, ()):
                slot.end(reason)
                ended += 1
        return ended

    def _release(self, slot: StreamSlot) -> None:
        self.open -= 1
        slots = self._by_key.get(slot.key_id)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self._by_key[slot.key_id]
        left = self._by_tenant.get(slot.tenant_id, 1) - 1
        if left > 0:
            self._by_tenant[slot.tenant_id] = left
        else:
            self._by_tenant.pop(slot.tenant_id, None)


class KeyRecheck:
    """Ends the places of keys revoked while their streams and long polls are open: every
    `interval` seconds, one statement asks which of the keys holding places are unrevoked
    (none while nothing is open). The revoked ones are also dropped from the key cache, so
    their next request in this process is refused at once, not after the cache's 5 s.

    A failed check (the database unreachable) is logged and retried at the next interval;
    open streams go on meanwhile, as they would without this check."""

    def __init__(
        self,
        limits: StreamLimits,
        active_keys: Callable[[set[UUID]], Awaitable[set[UUID]]],
        *,
        interval: float,
        forget: Callable[[set[UUID]], None] = lambda _: None,
    ) -> None:
        self.limits = limits
        self.active_keys = active_keys
        self.interval = interval
        self.forget = forget
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> set[UUID]:
        """Check the keys holding places now; the ones found revoked, whose places it ended."""
        held = self.limits.held_keys()
        if not held:
            return set()
        revoked = held - await self.active_keys(held)
        if revoked:
            self.forget(revoked)
            ended = self.limits.end_for(revoked, KEY_REVOKED)
            log.info("ended %d streams and long polls of %d revoked keys", ended, len(revoked))
        return revoked

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="turnstile stream key recheck")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_once()
            except Exception:  # logged; the next interval tries again
                log.warning("could not recheck the keys of open streams", exc_info=True)


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
