"""Server-Sent Events, framed by FastAPI's own SSE support (`fastapi.sse`): a run's stream
(`GET /runs/{id}/events`) and a session's (`GET /sessions/{id}/events`).

Both carry durable events (rows of `run_events`, each with an SSE `id:` a reconnecting client
sends back as `Last-Event-ID`) and live `message.delta` events (never stored, no `id:`): the
pieces of the message a run is writing, as the process's notifier hears them on the
`turnstile_deltas` channel (`LiveWatch`). A delta names its run, the claim that wrote it
(`epoch`), its message within that claim (`message`) and where its text goes (`offset`); a
stream forwards a delta only while it is news: not once the stream has sent that message's
`message.completed`, and not when the run has since been claimed again (an older epoch).

Event ids: a run's stream uses the sequence number (`7`); a session's stream uses
`<run number within the session>.<sequence number>` (`3.7`), which orders the events of all
the session's runs. Durable events missed while disconnected are replayed first; live deltas
follow from the point the stream has caught up to.

Durable events are read by one statement per recheck (`watch_events`, `watch_session_events`),
woken by the run notifications (`RunWatch`), by a delta of a run the stream does not know yet
(a session's next run started), by a new run of its session (`LiveWatch`: the enqueue's
notification names the session, migration 0013, so a turn submitted through any API process
wakes it at once; one submitted through this process pokes it directly too), or by the recheck
timer (`recheck_seconds`). A session stream with no active run looks again after
`SESSION_IDLE_FIRST_SECONDS`, then twice as long each time up to `IDLE_RECHECK_SECONDS` (30 s):
a safety net for a notification lost while the listener reconnected.

Ending early: a stream whose key is revoked while it is open (found by `KeyRecheck`,
app/api/watch.py) sends `stream.ended` with `{"reason": "key-revoked", "detail": ...}` (no `id`:
nothing to resume from) and closes; reconnecting with that key answers 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

from fastapi import Request
from fastapi.sse import KEEPALIVE_COMMENT, EventSourceResponse, ServerSentEvent, format_sse_event
from starlette.types import Receive, Scope, Send

from app.api.auth import visible_principal, visible_tenant
from app.api.services import state_of
from app.api.watch import (
    IDLE_RECHECK_SECONDS,
    KEY_REVOKED,
    STREAM_RECHECK_SECONDS,
    Inbox,
    StreamSlot,
    recheck_seconds,
)
from app.security.api_keys import Caller
from app.vocabulary.live_deltas import Delta
from app.vocabulary.records import Event
from app.vocabulary.statuses import TERMINAL

KEEPALIVE_SECONDS = 15.0  # proxies close connections that stay silent much longer
STREAM_PAGE = 500
SESSION_IDLE_FIRST_SECONDS = 1.0
HELD_DELTAS = 256  # deltas of a session's next run kept until the stream reaches that run
DELTA_EVENT = "message.delta"
COMPLETED_EVENT = "message.completed"
ENDED_EVENT = "stream.ended"
ENDED_DETAIL = {
    KEY_REVOKED: "the API key this stream was opened with has been revoked; reconnecting with "
    "it answers 401",
}


class HeldStream(EventSourceResponse):
    """An SSE response that gives its place back however it ends: finished, client gone,
    server stopping, or never started (the place is taken before the response exists)."""

    def __init__(self, slot: StreamSlot, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


def frame(event: ServerSentEvent) -> bytes:
    """One event in the SSE wire format, its data as JSON. The `id:` line comes first, as this
    API has always sent it (`format_sse_event` puts it last; the order means nothing to a
    conforming parser, but line-by-line readers written against this API expect it first)."""
    body = format_sse_event(
        data_str=None if event.data is None else json.dumps(event.data, separators=(",", ":")),
        event=event.event,
        comment=event.comment,
    )
    return body if event.id is None else f"id: {event.id}\n".encode() + body


def durable(event: Event, event_id: str, extra: dict[str, Any] | None = None) -> bytes:
    return frame(
        ServerSentEvent(
            id=event_id,
            event=event.type,
            data={
                **(extra or {}),
                "seq": event.seq,
                "type": event.type,
                "epoch": event.epoch,
                "data": event.data,
                "created_at": event.created_at.isoformat(),
            },
        )
    )


def ended(slot: StreamSlot) -> bytes:
    """The last event of a stream ended early, saying why (not durable: no `id`)."""
    reason = slot.reason or KEY_REVOKED
    return frame(
        ServerSentEvent(
            event=ENDED_EVENT,
            data={"reason": reason, "detail": ENDED_DETAIL.get(reason, reason)},
        )
    )


def live(delta: Delta) -> bytes:
    return frame(
        ServerSentEvent(
            event=DELTA_EVENT,
            data={
                "run_id": str(delta.run_id),
                "epoch": delta.epoch,
                "message": delta.message,
                "offset": delta.offset,
                "text": delta.text,
            },
        )
    )


class DeltaFilter:
    """What a stream knows of one run's messages, to forward only deltas that are news."""

    def __init__(self, run_id: UUID) -> None:
        self.run_id = run_id
        self.epoch = 0  # the newest claim the stream has seen an event of
        self.completed: set[tuple[int, int]] = set()  # (epoch, message) already sent whole

    def saw(self, event: Event) -> None:
        self.epoch = max(self.epoch, event.epoch)
        if event.type == COMPLETED_EVENT and isinstance(event.data, dict):
            self.completed.add((event.epoch, int(event.data.get("message", 0))))

    def news(self, delta: Delta) -> bool:
        return (
            delta.run_id == self.run_id
            and delta.epoch >= self.epoch
            and (delta.epoch, delta.message) not in self.completed
        )


async def wait(
    inbox: Inbox, changed: asyncio.Event, shutdown: asyncio.Event, seconds: float, slot: StreamSlot
) -> None:
    events = (changed, shutdown, inbox.ready, slot.ended)
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def run_stream(
    request: Request, run_id: UUID, caller: Caller, after: int, slot: StreamSlot
) -> AsyncIterator[bytes]:
    """A run's events and live deltas. Each recheck is one statement (where the run stands and
    what is new); keep-alive comments in between cost the database nothing. Ends early, with
    `stream.ended`, when `slot` is ended (its key revoked)."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    next_check = loop.time()  # at once: the first page
    known = DeltaFilter(run_id)
    caught_up = False
    with (
        state.watch.watching(str(run_id)) as changed,
        state.live.following(run_id=run_id) as inbox,
    ):
        while not state.shutdown.is_set():
            if slot.ended.is_set():
                yield ended(slot)
                return
            # Deltas first: one heard before this read was sent before the events it may
            # show (its notification committed first), so it goes out ahead of them.
            if caught_up and inbox.ready.is_set():
                for delta in inbox.take():
                    if known.news(delta):
                        yield live(delta)
                        last_sent = loop.time()
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()  # before the read, so a change during it wakes us again
                progress, events = await state.queue.watch_events(
                    run_id,
                    after=after,
                    limit=STREAM_PAGE,
                    tenant_id=visible_tenant(caller),
                    principal=visible_principal(caller),
                )
                if progress is None:
                    return  # deleted by retention meanwhile
                for event in events:
                    known.saw(event)
                    yield durable(event, str(event.seq))
                    after = event.seq
                    last_sent = loop.time()
                if len(events) == STREAM_PAGE:
                    continue  # more are waiting: next page at once
                caught_up = True
                if progress.status in TERMINAL and after >= progress.last_event_seq:
                    return
                next_check = loop.time() + recheck_seconds(
                    progress.status,
                    progress.scheduled_for,
                    active_seconds=STREAM_RECHECK_SECONDS,
                )
            if loop.time() - last_sent >= KEEPALIVE_SECONDS:
                yield KEEPALIVE_COMMENT
                last_sent = loop.time()
            pause = min(next_check, last_sent + KEEPALIVE_SECONDS) - loop.time()
            await wait(inbox, changed, state.shutdown, pause, slot)


async def session_stream(
    request: Request, session_id: UUID, run_no: int, after: int, slot: StreamSlot
) -> AsyncIterator[bytes]:
    """All the session's runs' events in order (ids `<run_no>.<seq>`), with their deltas, for as
    long as the client stays: a conversation's stream does not end with a run, only when
    `slot` is ended (its key revoked), with `stream.ended`."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    next_check = loop.time()
    current: DeltaFilter | None = None
    held: deque[Delta] = deque(maxlen=HELD_DELTAS)
    passed: deque[UUID] = deque(maxlen=16)  # runs the stream has finished with
    looked_for: deque[UUID] = deque(maxlen=16)  # unknown runs a recheck was made for
    run_no = max(run_no, 1)
    idle = SESSION_IDLE_FIRST_SECONDS  # the next pause while the session has no active run
    with contextlib.ExitStack() as watching, state.live.following(session_id=session_id) as inbox:
        changed = asyncio.Event()
        while not state.shutdown.is_set():
            if slot.ended.is_set():
                yield ended(slot)
                return
            # Deltas first (as in run_stream); those of a run the stream has not reached yet
            # wait in `held` for the read that reaches it.
            if inbox.ready.is_set():
                if inbox.poked:  # a turn submitted here: its run is there to read now
                    inbox.poked = False
                    next_check = loop.time()
                    idle = SESSION_IDLE_FIRST_SECONDS
                held.extend(inbox.take())
            if held:
                ahead = False  # deltas of a run the stream has not reached
                for delta in list(held):
                    held.popleft()
                    if current is not None and current.news(delta):
                        yield live(delta)
                        last_sent = loop.time()
                    elif delta.run_id not in passed and (
                        current is None or delta.run_id != current.run_id
                    ):
                        held.append(delta)
                        if delta.run_id not in looked_for:
                            looked_for.append(delta.run_id)
                            ahead = True
                if ahead:
                    next_check = loop.time()  # a new run started: look for it now
                    idle = SESSION_IDLE_FIRST_SECONDS
                    continue
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()
                progress, events = await state.queue.watch_session_events(
                    session_id, from_run_no=run_no, after=after, limit=STREAM_PAGE
                )
                if progress is None:
                    next_check = loop.time() + idle
                    idle = min(idle * 2, IDLE_RECHECK_SECONDS)
                else:
                    if current is None or current.run_id != progress.run_id:
                        # A run the stream reaches now: watch its notifications instead.
                        if current is not None:
                            passed.append(current.run_id)
                        current = DeltaFilter(progress.run_id)
                        watching.close()
                        changed = watching.enter_context(state.watch.watching(str(progress.run_id)))
                        if progress.run_no != run_no:
                            run_no, after = progress.run_no, 0
                    for event in events:
                        current.saw(event)
                        yield durable(
                            event,
                            f"{progress.run_no}.{event.seq}",
                            {"run_id": str(progress.run_id), "run_no": progress.run_no},
                        )
                        after = event.seq
                        last_sent = loop.time()
                    if len(events) == STREAM_PAGE:
                        continue
                    done = progress.status in TERMINAL and after >= progress.last_event_seq
                    if done and progress.has_next:
                        run_no, after = run_no + 1, 0
                        continue  # the next run (the read skips numbers retention removed)
                    if done:
                        pause = idle
                        idle = min(idle * 2, IDLE_RECHECK_SECONDS)
                    else:
                        idle = SESSION_IDLE_FIRST_SECONDS
                        pause = recheck_seconds(
                            progress.status,
                            progress.scheduled_for,
                            active_seconds=STREAM_RECHECK_SECONDS,
                        )
                    next_check = loop.time() + pause
            if loop.time() - last_sent >= KEEPALIVE_SECONDS:
                yield KEEPALIVE_COMMENT
                last_sent = loop.time()
            pause = min(next_check, last_sent + KEEPALIVE_SECONDS) - loop.time()
            await wait(inbox, changed, state.shutdown, pause, slot)
