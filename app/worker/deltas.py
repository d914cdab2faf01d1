"""The delta publisher: one per worker process, it carries the live output of all the process's
runs to the API processes that hold streams, within the bounds of
docs/adr/0007-live-output-deltas.md:

- at most `max_per_second` notifications a second (10), each at most `max_payload_bytes`
  (4,000) once encoded: a tick sends one payload holding every buffered delta that fits,
  contiguous pieces of one message merged (app/vocabulary/live_deltas.py: `pack`);
- on its own connection (`DeltaChannel`: a dedicated asyncpg connection in autocommit), outside
  every fenced transaction: a run's lease, heartbeat and writes never wait on it;
- `offer` never blocks and never fails: the buffer holds at most `max_buffered_chars`
  characters, and a delta that does not fit is dropped (counted), as is everything buffered
  while the connection is down;
- every `usage_check_seconds` it reads `pg_notification_queue_usage()` (exported as
  `turnstile_notification_queue_usage_ratio`); above `max_queue_usage` (1 %) it sends nothing
  and drops what it holds until the usage is back under.

A run that is about to write `message.completed` may `settle` its deltas: wait, at most one
tick, until what it offered was sent, so its stream shows the last pieces before the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from uuid import UUID

from app.observability.metrics import Metrics
from app.store.delta_channel import DeltaChannel
from app.store.primary import LOST_PRIMARY
from app.vocabulary.live_deltas import MAX_PAYLOAD_BYTES, Delta, pack

log = logging.getLogger("turnstile.deltas")


class DeltaPublisher:
    def __init__(
        self,
        url: str,
        *,
        max_per_second: float = 10.0,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        max_buffered_chars: int = 65_536,
        max_queue_usage: float = 0.01,
        usage_check_seconds: float = 1.0,
        metrics: Metrics | None = None,
        application_name: str = "turnstile deltas",
        channel: DeltaChannel | None = None,
    ) -> None:
        if not 0 < max_per_second <= 10:
            raise ValueError("max_per_second must be in (0, 10]")
        if not 0 < max_payload_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"max_payload_bytes must be in (0, {MAX_PAYLOAD_BYTES}]")
        self.url = url
        self.interval = 1.0 / max_per_second
        self.max_payload_bytes = max_payload_bytes
        self.max_buffered_chars = max_buffered_chars
        self.max_queue_usage = max_queue_usage
        self.usage_check_seconds = usage_check_seconds
        self.metrics = metrics
        self.application_name = application_name
        self._buffer: deque[Delta] = deque()
        self._buffered_chars = 0
        self._pending: dict[UUID, int] = {}  # run id -> deltas of it in the buffer
        self._wake = asyncio.Event()
        self._sent = asyncio.Event()  # set after every tick; settle waits on it
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Its connection: opened at the first tick (and again after a loss) unless given.
        self._channel: DeltaChannel | None = channel
        self._last_usage_check = float("-inf")
        self.paused = False  # the notification queue is above max_queue_usage
        self.usage = 0.0
        # Counters (also in Prometheus when `metrics` is given), read by tests and the bench.
        self.notifications = 0
        self.sent_deltas = 0
        self.dropped = {"full": 0, "paused": 0, "disconnected": 0}
        self.largest_payload = 0
        # When each of the last notifications' ticks began (monotonic): the rate bound's record.
        self.send_starts: deque[float] = deque(maxlen=1_000)

    # --- what runs call -----------------------------------------------------------------------
    def offer(self, delta: Delta) -> bool:
        """Buffer `delta` for the next tick; False (and dropped) when the buffer is full or the
        notification queue is too full to send. Never blocks."""
        if not delta.text:
            return True
        if self.paused:
            self._drop("paused", 1)
            self._wake.set()  # the loop reads the usage again (when due) and may resume
            return False
        if self._buffered_chars + len(delta.text) > self.max_buffered_chars:
            self._drop("full", 1)
            return False
        self._buffer.append(delta)
        self._buffered_chars += len(delta.text)
        self._pending[delta.run_id] = self._pending.get(delta.run_id, 0) + 1
        self._wake.set()
        return True

    async def settle(self, run_id: UUID, within: float | None = None) -> bool:
        """Wait until no delta of `run_id` is buffered (sent or dropped), at most `within`
        seconds (default: two ticks); True when none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (2 * self.interval if within is None else within)
        while self._pending.get(run_id):
            remaining = deadline - loop.time()
            if remaining <= 0 or self._task is None:
                return False
            self._sent.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sent.wait(), remaining)
        return True

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name="turnstile-deltas")

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
            self._channel = None

    # --- the loop -----------------------------------------------------------------------------
    async def _run(self) -> None:
        reconnect = 0.05
        while not self._stopping.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stopping.is_set():
                return
            started = time.monotonic()
            try:
                if await self.tick():
                    self.send_starts.append(started)
                reconnect = 0.05
            except LOST_PRIMARY as exc:
                log.warning("delta publishing failed; dropping", extra={"error": repr(exc)})
                self._drop_all("disconnected")
                if self._channel is not None:
                    with contextlib.suppress(Exception):
                        await self._channel.close()
                self._channel = None
                await self._pause(reconnect)
                reconnect = min(reconnect * 2, 5.0)
            finally:
                self._sent.set()
            if self._buffer:
                self._wake.set()
            # The rate bound: the next notification no sooner than one interval after this one.
            await self._pause(self.interval - (time.monotonic() - started))

    async def tick(self) -> bool:
        """One round: check the queue usage when due, then send at most one notification;
        True when it sent one."""
        if self._channel is None or self._channel.closed:
            self._channel = await DeltaChannel.connect(
                self.url, application_name=self.application_name
            )
        now = time.monotonic()
        if now - self._last_usage_check >= self.usage_check_seconds:
            self._last_usage_check = now
            self.usage = await self._channel.usage()
            if self.metrics is not None:
                self.metrics.notification_queue_usage.set(self.usage)
            was = self.paused
            self.paused = self.usage > self.max_queue_usage
            if self.paused != was:
                log.warning(
                    "delta publishing %s",
                    "paused" if self.paused else "resumed",
                    extra={"notification_queue_usage": self.usage},
                )
        if self.paused:
            self._drop_all("paused")
            return False
        if not self._buffer:
            return False
        taken = list(self._buffer)
        payload, rest = pack(taken, self.max_payload_bytes)
        await self._channel.send(payload)
        size = len(payload.encode())
        self.largest_payload = max(self.largest_payload, size)
        self.notifications += 1
        sent = sum(len(d.text) for d in taken) - sum(len(d.text) for d in rest)
        self.sent_deltas += len(taken) - len(rest)
        if self.metrics is not None:
            self.metrics.delta_notifications.inc()
            self.metrics.delta_chars_sent.inc(sent)
        # Pieces offered while the notification was being sent are behind what was taken.
        arrived = list(self._buffer)[len(taken) :]
        self._replace_buffer([*rest, *arrived])
        return True

    # --- bookkeeping --------------------------------------------------------------------------
    def _replace_buffer(self, rest: list[Delta]) -> None:
        self._buffer = deque(rest)
        self._buffered_chars = sum(len(d.text) for d in rest)
        self._pending = {}
        for delta in rest:
            self._pending[delta.run_id] = self._pending.get(delta.run_id, 0) + 1

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        if self.metrics is not None:
            self.metrics.delta_drops.labels(reason).inc(count)

    def _drop_all(self, reason: str) -> None:
        if self._buffer:
            self._drop(reason, len(self._buffer))
            self._replace_buffer([])

    async def _pause(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
