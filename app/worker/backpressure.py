"""Backpressure: whether the worker pool can serve another run now, measured, not guessed.

A pool whose event loop is behind cannot serve what it already holds: each run it claims then
waits for the loop before its first step, holding a lease and a slot while another process
could have run it. So the claim loops ask `Backpressure.holding_back()` before each claim, and
claim nothing while it is true:

- the event loop's lag: a ticker task sleeps `tick` seconds and measures how late it woke; a
  loop blocked now (no tick for longer than the limit) counts as lagging from the moment it
  is, not only after its next tick;
- the CPU of the event loop's thread (`time.thread_time`, sampled by the ticker) over the last
  window, as a share of one core: at the limit the loop runs nothing but work, and one more
  run only makes every other one later.

It recovers on its own: once its ticks have been on time for `RECOVERY_SECONDS` and the CPU
share is below the limit, the pool claims again. The heartbeats do not depend on it (they
have their own thread, app/worker/heartbeat.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

TICK_SECONDS = 0.05
"""How often the ticker wakes: a lag is seen within about this much of its start."""

CPU_WINDOW_SECONDS = 1.0
"""The window the CPU share is measured over."""

RECOVERY_SECONDS = 0.5
"""After a late tick the pool holds back this much longer: a loop that just stalled for a
second is likely to stall again, and a run claimed into it would sit unserved."""


class Backpressure:
    def __init__(
        self,
        *,
        max_lag_seconds: float = 0.2,
        max_cpu: float = 0.95,
        tick_seconds: float = TICK_SECONDS,
        cpu_window_seconds: float = CPU_WINDOW_SECONDS,
        recovery_seconds: float = RECOVERY_SECONDS,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.max_lag = max_lag_seconds
        self.max_cpu = max_cpu
        self.tick = tick_seconds
        self.cpu_window = cpu_window_seconds
        self.recovery = recovery_seconds
        self._late_until = 0.0
        self._on_lag = on_lag
        self.lag = 0.0  # how late the last tick woke
        self.max_lag_seen = 0.0
        self.cpu = 0.0  # the loop thread's CPU share of one core over the last window
        self._expected = time.monotonic() + tick_seconds
        self._window_start = (time.monotonic(), time.thread_time())
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._expected = time.monotonic() + self.tick
            self._window_start = (time.monotonic(), time.thread_time())
            self._task = asyncio.create_task(self._ticker(), name="turnstile-backpressure")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def current_lag(self) -> float:
        """The last tick's lag, or how late the next tick is already, whichever is larger."""
        overdue = time.monotonic() - self._expected
        return max(self.lag, overdue)

    def holding_back(self) -> bool:
        if self._task is None:
            return False  # not measuring (a pool built without a running ticker)
        return (
            self.current_lag() > self.max_lag
            or time.monotonic() < self._late_until
            or self.cpu >= self.max_cpu
        )

    async def _ticker(self) -> None:
        while True:
            self._expected = time.monotonic() + self.tick
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            self.lag = max(now - self._expected, 0.0)
            self.max_lag_seen = max(self.max_lag_seen, self.lag)
            if self.lag > self.max_lag:
                self._late_until = now + self.recovery
            if self._on_lag is not None:
                self._on_lag(self.lag)
            started, cpu_started = self._window_start
            if now - started >= self.cpu_window:
                cpu_now = time.thread_time()
                self.cpu = (cpu_now - cpu_started) / (now - started)
                self._window_start = (now, cpu_now)
