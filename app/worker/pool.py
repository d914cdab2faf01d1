"""The worker pool: claim loops per slot group, executions, batched heartbeats, drain.

- Each slot group has a claim loop that claims up to its free slots in one statement (ADR-0004
  decision 2: capacity is reserved per group, so an async backlog never takes an interactive
  slot). It sleeps until a notification names one of its priorities, a slot frees up, the
  earliest queued run of its classes that is not eligible yet becomes eligible (a scheduled
  run, a schedule's tick, a backed-off retry: `Queue.next_due`, asked when a claim found less
  than it could take), or the poll interval passes. So such runs start within moments of their
  time, with no notification per run. A claim that returned runs is followed at once by
  another (it may have skipped runs other claimers held, or taken only a fair share of each
  tenant: docs/adr/0006); the loop sleeps only after a claim that found nothing.
- A claimed run that is a schedule's tick has its schedule's next tick created at once, in a
  task of its own (`Schedules.advance`; the scheduler maintenance service repairs a miss).
- Each claimed run executes in its own task; every database call it makes draws its own pooled
  connection (an AsyncSession or connection is never shared between tasks).
- Completions of a slot group's runs are group-committed (`completions.py`): the runs that
  finish while one batch commits go together in the next statement, each fenced on its own.
- One heartbeat statement per process per interval extends every held lease, sent from a thread
  of its own with a connection of its own (app/worker/heartbeat.py), so work that keeps the
  event loop busy never delays it. A lease reported lost cancels its execution at once and
  records `run.fenced`. When heartbeats fail with errors (not fencing) until the lease deadline
  by this process's monotonic clock, the execution is stopped (self-fencing): the sweeper will
  give the run to someone else, and this process must not act on it meanwhile.
- A pool claims only what it can serve: at most `claim_batch_max` runs per claim, and nothing
  while its event loop lags or its thread's CPU is saturated (app/worker/backpressure.py;
  `turnstile_worker_holding_back` says so).
- `stop()` drains: no new claims, running executions get a grace period, the rest are released
  gracefully (requeued at once, attempt given back), and the worker row is marked stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from app.observability import tracing
from app.observability.logs import run_context
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.scheduling import Schedules
from app.store.housekeeping import WorkerRegistry
from app.vocabulary.classes import priorities_of
from app.vocabulary.layout import SlotGroup
from app.vocabulary.records import ClaimedRun
from app.worker.backpressure import Backpressure
from app.worker.completions import CompletionBatcher
from app.worker.execution import DeltaSink, ExecutionContext, Executor, StopExecution
from app.worker.heartbeat import HeartbeatThread
from app.worker.notifier import Notifier

log = logging.getLogger("turnstile.worker")

DUE_MARGIN_SECONDS = 0.005
"""Added to the wait for the next due run, so the claim after it finds the run eligible."""

CLAIM_BATCH_MAX = 128
"""At most this many runs per claim (TURNSTILE_CLAIM_BATCH_MAX): a large pool fills in steps,
each started before the next is claimed, so backpressure sees their load before claiming more."""

HOLD_BACK_PAUSE_SECONDS = 0.05
"""How long a claim loop waits before asking again while the pool holds back."""


@dataclass
class _Execution:
    ctx: ExecutionContext
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None  # "fenced", "self_fenced" or "drain" when the pool stops it


@dataclass
class _Group:
    spec: SlotGroup
    priorities: frozenset[int]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Keyed by (run id, epoch), never by the run alone: after the sweeper requeued a run whose
    # old execution here is still alive, this process may claim it again, and the two are
    # different holds with different fates.
    running: dict[tuple[UUID, int], _Execution] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    completions: CompletionBatcher | None = None

    @property
    def free(self) -> int:
        return self.spec.size - len(self.running)


def new_worker_id() -> str:
    """An opaque id: it lands in tenant-visible places (run.claimed and run.fenced events, the
    sweeper's failure message, the run's lease holder), so it must not name the machine or the
    process. The workers table maps it to host and pid for operators."""
    return f"w-{secrets.token_hex(8)}"


class WorkerPool:
    def __init__(
        self,
        queue: Queue,
        executor: Executor,
        groups: tuple[SlotGroup, ...],
        *,
        lease_seconds: float,
        heartbeat_seconds: float,
        poll_interval_seconds: float = 2.0,
        notifier: Notifier | None = None,
        role: str = "serve",
        worker_id: str | None = None,
        deltas: DeltaSink | None = None,
        claim_batch_max: int = CLAIM_BATCH_MAX,
        backpressure: Backpressure | None = None,
        metrics: Metrics | None = None,
        heartbeat_engine: Callable[[], AsyncEngine] | None = None,
    ) -> None:
        self.queue = queue
        self.claim_batch_max = claim_batch_max
        self.metrics = metrics
        # Builds the heartbeat thread's engine, in that thread (None: the queue's engine's twin).
        self.heartbeat_engine = heartbeat_engine
        self.backpressure = backpressure or Backpressure()
        if metrics is not None:
            self.backpressure._on_lag = metrics.worker_loop_lag.set
        self.holding_back = False
        self.held_back_rounds = 0
        self.held_back_ever = False
        self.deltas = deltas
        self.registry = WorkerRegistry(queue)
        self.schedules = Schedules(queue)
        self._advancing: set[asyncio.Task[None]] = set()
        self.executor = executor
        self.groups = [
            _Group(
                spec=g,
                priorities=frozenset(priorities_of(g.classes)),
                completions=CompletionBatcher(queue),
            )
            for g in groups
        ]
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.poll_interval = poll_interval_seconds
        self.notifier = notifier
        self.role = role
        self.worker_id = worker_id or new_worker_id()
        self._stopping = asyncio.Event()
        self._heartbeats: HeartbeatThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = asyncio.Event()  # a second stop signal: the drain's grace ends now
        self.started = False
        self.claimed_total = 0
        self.heartbeat_failures = 0
        if notifier is not None:
            notifier.on_work(self._on_work)

    # --- public -------------------------------------------------------------------------------
    def occupancy(self) -> dict[str, dict[str, int]]:
        return {g.spec.name: {"busy": len(g.running), "size": g.spec.size} for g in self.groups}

    def held(self) -> list[ExecutionContext]:
        return [e.ctx for g in self.groups for e in g.running.values()]

    def hurry(self) -> None:
        """End a drain's grace period now (a second Ctrl-C): what still runs is released at
        once, as at the grace's end, rather than awaited."""
        self._hurry.set()

    async def _within_grace(self, tasks: list[asyncio.Task[None]], grace_seconds: float) -> None:
        """Wait for every task, at most `grace_seconds`, and no longer once `hurry()` is called."""
        every = asyncio.ensure_future(asyncio.wait(tasks))
        hurried = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait(
            [every, hurried], timeout=grace_seconds, return_when=asyncio.FIRST_COMPLETED
        )
        every.cancel()  # the wait, not the tasks
        hurried.cancel()

    async def start(self) -> None:
        try:
            await self._register()
        except Exception:
            if self.groups:
                raise  # a pool that cannot register cannot be trusted to hold leases either
            # An API-only process registers on a best-effort basis: it must start even on an
            # unmigrated database, to answer /readyz with what is wrong.
            log.warning("could not register this API process", exc_info=True)
        self._loop = asyncio.get_running_loop()
        if self.groups:
            self.backpressure.start()
        for group in self.groups:
            group.task = asyncio.create_task(
                self._claim_loop(group), name=f"turnstile-claim-{group.spec.name}"
            )
        self._heartbeats = HeartbeatThread(
            self.queue,
            self._beat_from_thread,
            interval=self.heartbeat_seconds,
            on_lag=self.metrics.worker_heartbeat_lag.set if self.metrics is not None else None,
            engine=self.heartbeat_engine,
        )
        self._heartbeats.start()
        self.started = True
        log.info(
            "worker pool started",
            extra={
                "worker_id": self.worker_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "slots": self._slot_groups_json(),
            },
        )

    async def stop(self, grace_seconds: float = 10.0) -> None:
        """Drain: stop claiming now, let executions finish within the grace period, release
        the rest gracefully, then deregister. Safe to call more than once."""
        if not self.started:
            return
        self.started = False
        self._stopping.set()
        for group in self.groups:
            group.wake.set()
        await asyncio.gather(*(g.task for g in self.groups if g.task is not None))
        await asyncio.gather(*self._advancing, return_exceptions=True)
        executions = [e for g in self.groups for e in g.running.values() if e.task is not None]
        if executions:
            tasks = [e.task for e in executions if e.task is not None]
            await self._within_grace(tasks, grace_seconds)
            pending = {task for task in tasks if not task.done()}
            # An execution whose ending write is in flight is let finish it (one statement): an
            # interrupted one would leave the run's fate unknown to this process.
            in_flight = [
                e.task
                for e in executions
                if e.task in pending and e.ctx.finishing and not e.ctx.ended
            ]
            if in_flight:
                await asyncio.wait(in_flight, timeout=grace_seconds)
            for execution in executions:
                if execution.task is not None and not execution.task.done():
                    self._interrupt(execution, "drain")
            await asyncio.gather(*pending, return_exceptions=True)
        if self._heartbeats is not None:
            await self._heartbeats.stop()
        await self.backpressure.stop()
        self._set_holding_back(False)
        with contextlib.suppress(Exception):
            await self._deregister()
        log.info("worker pool stopped", extra={"worker_id": self.worker_id})

    # --- claiming -----------------------------------------------------------------------------
    def _on_work(self, priorities: set[int] | None) -> None:
        for group in self.groups:
            if priorities is None or group.priorities & priorities:
                group.wake.set()

    async def _claim_loop(self, group: _Group) -> None:
        failures = 0
        while not self._stopping.is_set():
            # Cleared before claiming, so a notification that lands during the claim is kept.
            group.wake.clear()
            free = group.free
            if free > 0 and self.backpressure.holding_back():
                # The loop cannot serve what it holds on time: a run claimed now would sit
                # unserved under its lease while another process could run it.
                self._set_holding_back(True)
                self.held_back_rounds += 1
                if self.metrics is not None:
                    self.metrics.worker_held_back_rounds.inc()
                await self._pause(HOLD_BACK_PAUSE_SECONDS)
                continue
            self._set_holding_back(False)
            if free > 0:
                sent = time.monotonic()
                try:
                    claimed = await self.queue.claim(
                        self.worker_id,
                        group.spec.classes,
                        limit=min(free, self.claim_batch_max),
                        lease_seconds=self.lease_seconds,
                    )
                    failures = 0
                except Exception:
                    failures += 1
                    log.warning(
                        "claim failed; retrying",
                        extra={"slot_group": group.spec.name, "failures": failures},
                        exc_info=failures == 1,
                    )
                    await self._pause(min(0.1 * 2**failures, self.poll_interval))
                    continue
                for item in claimed:
                    self._start(group, item, trusted_until=sent + self.lease_seconds)
                self.claimed_total += len(claimed)
                ticks = {c.run.schedule_id for c in claimed if c.run.schedule_id is not None}
                if ticks:
                    self._advance_schedules(ticks)
                if claimed:
                    # There may be more, even when the claim returned fewer than it asked for:
                    # it skipped rows other claimers had locked (SKIP LOCKED), or a fair batch
                    # took only its share of each tenant (docs/adr/0006). So the loop asks
                    # again at once, and waits only once slots are full or a claim found none.
                    continue
            wait = self.poll_interval
            if free > 0:
                wait = await self._until_due(group, wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(group.wake.wait(), timeout=wait)

    def _set_holding_back(self, value: bool) -> None:
        if value != self.holding_back:
            self.holding_back = value
            self.held_back_ever = self.held_back_ever or value
            if self.metrics is not None:
                self.metrics.worker_holding_back.set(1 if value else 0)

    async def _until_due(self, group: _Group, poll: float) -> float:
        """How long the loop may sleep: until the earliest run of its classes that is not
        eligible yet becomes eligible, at most `poll`."""
        try:
            due = await self.queue.next_due(group.spec.classes)
        except Exception:
            log.warning("next due run unknown", extra={"slot_group": group.spec.name})
            return poll
        if due is None:
            return poll
        return min(poll, due + DUE_MARGIN_SECONDS)

    def _advance_schedules(self, schedule_ids: set[UUID]) -> None:
        """Create the next ticks of the schedules whose ticks were just claimed, without
        delaying their executions."""

        async def advance() -> None:
            try:
                await self.schedules.advance(schedule_ids)
            except Exception:
                # The scheduler maintenance service creates any tick missing here.
                log.warning("could not create the next schedule ticks", exc_info=True)

        task = asyncio.create_task(advance(), name="turnstile-schedule-advance")
        self._advancing.add(task)
        task.add_done_callback(self._advancing.discard)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # --- executing ----------------------------------------------------------------------------
    def _start(self, group: _Group, claimed: ClaimedRun, *, trusted_until: float) -> None:
        ctx = ExecutionContext(
            queue=self.queue,
            claimed=claimed,
            slot_group=group.spec.name,
            lease_seconds=self.lease_seconds,
            trusted_until=trusted_until,
            completions=group.completions,
            deltas=self.deltas,
        )
        execution = _Execution(ctx=ctx)
        group.running[claimed.lease.key] = execution
        execution.task = asyncio.create_task(
            self._execute(group, execution), name=f"turnstile-run-{claimed.lease.run_id}"
        )

    def _interrupt(self, execution: _Execution, reason: str) -> None:
        if execution.stop_reason is None:
            execution.stop_reason = reason
            if reason == "fenced":
                execution.ctx.lost()
            elif reason == "self_fenced":
                execution.ctx.lapsed()
            if execution.task is not None:
                execution.task.cancel()

    async def _execute(self, group: _Group, execution: _Execution) -> None:
        """The hold, in its claim's span: a child of the trace the run keeps, whichever process
        or claim this is."""
        ctx = execution.ctx
        run = ctx.claimed.run
        with tracing.claim(
            run.traceparent,
            {
                "turnstile.run.id": str(run.id),
                "turnstile.run.attempt": run.attempts,
                "turnstile.lease.epoch": ctx.lease.epoch,
                "turnstile.run.class": run.priority_class.value,
                "turnstile.agent": run.agent,
                "turnstile.worker.id": self.worker_id,
                "turnstile.slot_group": group.spec.name,
            },
        ) as span:
            try:
                await self._hold(group, execution)
            finally:
                span.set({"turnstile.claim.stopped": execution.stop_reason})

    async def _hold(self, group: _Group, execution: _Execution) -> None:
        ctx = execution.ctx
        run_id = ctx.lease.run_id
        run = ctx.claimed.run
        # Every log line of this task names the run it is about.
        run_context.set(
            {
                "run_id": str(run_id),
                "session_id": str(run.session_id) if run.session_id else None,
                "epoch": ctx.lease.epoch,
                "worker_id": self.worker_id,
                "slot_group": group.spec.name,
            }
        )
        # At debug: a line per run at info cost the no-op path 6 % of its CPU (docs/performance.md);
        # the run's failures, fences and losses still log at info and above, naming the run.
        log.debug("executing run", extra={"attempt": run.attempts, "agent": run.agent})
        try:
            await self.executor.execute(ctx)
        except asyncio.CancelledError:
            if execution.stop_reason is None:
                raise  # not ours: the event loop is going away
        except StopExecution:
            pass
        except Exception as exc:
            log.exception(
                "executor failed; releasing the run with backoff",
                extra={"run_id": str(run_id), "epoch": ctx.lease.epoch},
            )
            await ctx.release_after_error(f"executor error: {exc!r}"[:500])
        finally:
            try:
                await self._after(execution)
            finally:
                group.running.pop(ctx.lease.key, None)
                group.wake.set()

    async def _after(self, execution: _Execution) -> None:
        ctx = execution.ctx
        if execution.stop_reason == "fenced":
            await ctx.stop_fenced("heartbeat")
        elif execution.stop_reason == "drain":
            await ctx.release_for_drain()
        elif execution.stop_reason == "self_fenced":
            log.warning(
                "self-fenced: heartbeats failed until the lease deadline",
                extra={"run_id": str(ctx.lease.run_id), "epoch": ctx.lease.epoch},
            )
        elif ctx.self_fenced:
            # The executor's own check before a step found the lease past its deadline (the
            # process was frozen or starved): it stopped without a write; say so.
            log.warning(
                "self-fenced: the lease may have lapsed before the next step",
                extra={"run_id": str(ctx.lease.run_id), "epoch": ctx.lease.epoch},
            )

    # --- heartbeats ---------------------------------------------------------------------------
    @property
    def heartbeat_lag_max(self) -> float:
        """The largest lag of a heartbeat so far (late start plus its statement), seconds."""
        return self._heartbeats.max_lag if self._heartbeats is not None else 0.0

    async def _beat_from_thread(self, queue: Queue) -> None:
        """One beat, in the heartbeat thread on its own connection: what it finds about a
        lease is acted on in the pool's loop."""
        loop = self._loop
        assert loop is not None

        def dispatch(action: Callable[..., Any], *args: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the pool's loop is gone: nothing to stop
                loop.call_soon_threadsafe(action, *args)

        await self.beat(queue, dispatch)

    async def beat(
        self, queue: Queue | None = None, dispatch: Callable[..., None] | None = None
    ) -> None:
        """One heartbeat for every held lease, in one statement (on `queue`, the heartbeat
        thread's; by default the pool's own, in its loop). Renewals take effect at once;
        fences and self-fences go through `dispatch` (by default run here)."""
        queue = queue or self.queue
        act: Callable[..., None] = dispatch or (lambda action, *args: action(*args))
        executions = self._holding()
        sent = time.monotonic()
        try:
            held = await queue.heartbeat_many(
                [e.ctx.lease for e in executions], lease_seconds=self.lease_seconds
            )
        except Exception:
            self.heartbeat_failures += 1
            log.warning("heartbeat failed", exc_info=self.heartbeat_failures == 1)
            now = time.monotonic()
            for execution in executions:
                if now >= execution.ctx.trusted_until:
                    act(self._stop_unless_finishing, execution, "self_fenced")
            return
        if executions:  # a beat with nothing to renew sent nothing: it proves nothing either
            self.heartbeat_failures = 0
        for execution in executions:
            if execution.ctx.lease.key in held:
                execution.ctx.renewed(until=sent + self.lease_seconds)
            else:
                act(self._stop_unless_finishing, execution, "fenced")
        try:
            # The registry row, after the leases; its failure does not touch any lease.
            await WorkerRegistry(queue).touch(self.worker_id, slot_groups=self._slot_groups_json())
        except Exception:
            log.warning("worker registration refresh failed", exc_info=True)

    def _holding(self) -> list[_Execution]:
        """The executions whose leases a beat renews. Read from the heartbeat thread while the
        pool's loop changes the groups: a copy of each group's entries is taken at once, and
        taken again in the rare case that a change landed during it."""
        for _ in range(10):
            try:
                return [
                    e
                    for g in self.groups
                    for e in list(g.running.values())
                    if e.stop_reason is None and not e.ctx.finishing
                ]
            except RuntimeError:  # changed size during iteration
                continue
        return []

    def _stop_unless_finishing(self, execution: _Execution, reason: str) -> None:
        # Decided in the pool's loop: the ending write may have started since the beat began,
        # and then its own fence decides.
        if not execution.ctx.finishing:
            self._interrupt(execution, reason)

    # --- registration -------------------------------------------------------------------------
    def _slot_groups_json(self) -> str:
        return json.dumps([{**g.spec.describe(), "busy": len(g.running)} for g in self.groups])

    async def _register(self) -> None:
        await self.registry.register(
            self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            role=self.role,
            slot_groups=self._slot_groups_json(),
        )

    async def _deregister(self) -> None:
        await self.registry.deregister(self.worker_id)
