"""A Hypothesis state machine over the queue core with a controlled clock: claims, heartbeats,
time passing, sweeps, fenced writes, waits, deliveries, releases, cancels, completions and
failures in any order, by several workers holding current and stale leases.

After every step: a write succeeds exactly when its lease is current (same epoch, run
running), a fenced write changes nothing, attempts follow the brief's definition (a claim adds
one, a graceful release gives it back, waiting resets to 0, nothing else changes it), terminal
statuses are final, and every run's log satisfies the invariants (one terminal transition,
gap-free sequence, epochs never going backwards).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import text

from app.config import Settings
from app.queue.core import Queue, QueueConfig
from app.queue.errors import RunFinishedError, RunNotWaitingError
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, Run, ToolCall, Written
from tests.support.clock import ManualClock
from tests.support.invariants import check_log, read_log

T = TypeVar("T")
SEEN: Counter[str] = Counter()  # what the machine exercised, printed with -s
SEEN: Counter[str] = Counter()
WORKERS = ("w0", "w1", "w2")
TERMINAL = {"succeeded", "failed", "cancelled"}
WRITES = (
    "append",
    "tool_started",
    "tool_finished",
    "checkpoint",
    "wait",
    "complete",
    "fail",
    "release_graceful",
    "release_early",
)


def make_machine(database_url: str) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.clock = ManualClock()
            self.engine = create_engine(Settings(), database_url, pool_size=2)
            self.queue = Queue(
                self.engine,
                QueueConfig(
                    lease_seconds=30, max_attempts=3, backoff_base_seconds=5, backoff_max_seconds=60
                ),
                clock=self.clock,
            )
            self.run_ids: list[UUID] = []
            self.leases: list[Lease] = []  # every lease handed out, current or stale
            self.attempts: dict[UUID, int] = {}
            self.finished: dict[UUID, str] = {}
            # Leases whose holder ended its own hold (wait, complete, fail, release): a worker
            # writes nothing more for them, so a later write here records no run.fenced.
            self.ended: set[tuple[UUID, int]] = set()
            self.do(self._truncate())

        def do(self, coro: Coroutine[Any, Any, T]) -> T:
            return self.loop.run_until_complete(coro)

        async def _truncate(self) -> None:
            async with self.engine.begin() as conn:
                await conn.execute(text("TRUNCATE runs, sessions CASCADE"))

        def teardown(self) -> None:
            self.do(self.engine.dispose())
            self.loop.close()

        def run(self, run_id: UUID) -> Run:
            found = self.do(self.queue.get_run(run_id))
            assert found is not None
            return found

        def current(self, lease: Lease) -> bool:
            run = self.run(lease.run_id)
            return run.status == "running" and run.lease_epoch == lease.epoch

        # --- rules ------------------------------------------------------------------------
        @initialize(klasses=st.lists(st.sampled_from(list(PriorityClass)), min_size=2, max_size=4))
        def start_with_runs(self, klasses: list[PriorityClass]) -> None:
            for klass in klasses:
                self.enqueue(klass, None)

        @precondition(lambda self: len(self.run_ids) - len(self.finished) < 4)
        @rule(klass=st.sampled_from(list(PriorityClass)), delay=st.sampled_from([None, 0, 20]))
        def enqueue(self, klass: PriorityClass, delay: int | None) -> None:
            scheduled = None if delay is None else self.clock.now + timedelta(seconds=delay)
            run = self.do(
                self.queue.enqueue(
                    NewRun(
                        tenant_id="t",
                        principal="p",
                        agent="scripted",
                        input={},
                        priority=klass.base,
                        scheduled_for=scheduled,
                    )
                )
            )
            self.run_ids.append(run.id)
            self.attempts[run.id] = 0

        @rule(worker=st.sampled_from(WORKERS), limit=st.sampled_from([1, 2]))
        def claim(self, worker: str, limit: int) -> None:
            eligible = [
                r
                for r in (self.run(i) for i in self.run_ids)
                if r.status == "queued" and r.eligible_at <= self.clock.now
            ]
            claimed = self.do(self.queue.claim(worker, list(PriorityClass), limit=limit))
            assert len(claimed) == min(limit, len(eligible))
            # Priority, then eligibility time; runs tied on both may come in either order.
            keys = sorted((r.priority, r.eligible_at) for r in eligible)
            assert [(c.run.priority, c.run.eligible_at) for c in claimed] == keys[: len(claimed)]
            for c in claimed:
                self.attempts[c.run.id] += 1
                self.leases.append(c.lease)

        @rule(seconds=st.sampled_from([1, 10, 31, 90]))
        def advance(self, seconds: int) -> None:
            self.clock.advance(seconds)

        @rule()
        def sweep(self) -> None:
            before = {i: self.run(i) for i in self.run_ids}
            expired = [
                r
                for r in before.values()
                if r.status == "running"
                and r.lease_expires_at is not None
                and r.lease_expires_at < self.clock.now
            ]
            report = self.do(self.queue.sweep())
            assert report.requeued + report.failed == len(expired)
            for r in expired:
                after = self.run(r.id)
                assert after.status == ("failed" if r.attempts >= r.max_attempts else "queued")
                if after.status == "failed":
                    self.finished[r.id] = "failed"

        @precondition(lambda self: bool(self.leases))
        @rule(which=st.integers(0, 9), one=st.booleans())
        def heartbeat(self, which: int, one: bool) -> None:
            lease = self.leases[-1 - which % len(self.leases)]
            if one:
                assert self.do(self.queue.heartbeat(lease)) is self.current(lease)
            else:
                mine = [held for held in self.leases if held.owner == lease.owner]
                expected = {held.key for held in mine if self.current(held)}
                assert self.do(self.queue.heartbeat_many(mine)) == expected

        def write(self, which: int, kind: str) -> None:
            # Recent leases first: they are the ones most likely to still be current.
            lease = self.leases[-1 - which % len(self.leases)]
            valid = self.current(lease)
            before = self.run(lease.run_id)
            SEEN[f"{kind} on a {'current' if valid else before.status} lease"] += 1
            SEEN[f"{kind} on a {'current' if valid else before.status} lease"] += 1
            call = ToolCall(step=1, tool="echo", idempotency_class="safe", args={})
            q = self.queue
            outcome = self.do(
                {
                    "append": lambda: q.append_event(lease, "agent.note", {}),
                    "tool_started": lambda: q.tool_started(lease, call),
                    "tool_finished": lambda: q.tool_finished(lease, call, "succeeded", {}, {}),
                    "checkpoint": lambda: q.save_checkpoint(lease, 1, {}),
                    "wait": lambda: q.wait_for_user(lease, "?", step=1, state={}),
                    "complete": lambda: q.complete(lease, {}),
                    "fail": lambda: q.fail(lease, {"kind": "permanent"}),
                    "release_graceful": lambda: q.release(lease, graceful=True),
                    "release_early": lambda: q.release(lease, graceful=False),
                }[kind]()
            )
            after = self.run(lease.run_id)
            if not valid:
                assert isinstance(outcome, Fenced)
                assert after == before, "a fenced write changed the run"
                if lease.key not in self.ended:
                    seq = self.do(q.record_fenced(lease, during=kind))
                    assert seq == before.last_event_seq + 1
                return
            assert isinstance(outcome, Written)
            assert outcome.seq == after.last_event_seq
            if kind in ("wait", "complete", "fail", "release_graceful", "release_early"):
                self.ended.add(lease.key)
            if kind == "wait":
                self.attempts[lease.run_id] = 0
                assert after.status == "waiting_for_user"
            elif kind == "release_graceful":
                self.attempts[lease.run_id] -= 1
                assert after.status == "queued"
            elif kind == "release_early":
                assert after.status == (
                    "failed" if before.attempts >= before.max_attempts else "queued"
                )
            elif kind in ("complete", "fail"):
                assert after.status == {"complete": "succeeded", "fail": "failed"}[kind]
            else:
                assert after.status == "running"
            if after.status in TERMINAL:
                self.finished[after.id] = after.status

        @precondition(lambda self: bool(self.run_ids))
        @rule(which=st.integers(0, 3))
        def deliver(self, which: int) -> None:
            run_id = self.run_ids[which % len(self.run_ids)]
            waiting = self.run(run_id).status == "waiting_for_user"
            try:
                resumed = self.do(self.queue.deliver_input(run_id, "answer", principal="p"))
            except RunNotWaitingError:
                assert not waiting
                return
            assert waiting
            assert resumed.status == "queued"

        @precondition(lambda self: bool(self.run_ids))
        @rule(which=st.integers(0, 3), now=st.integers(0, 3))
        def cancel(self, which: int, now: int) -> None:
            if now:
                return  # cancel one time in four: it ends runs the other rules need
            run_id = self.run_ids[which % len(self.run_ids)]
            before = self.run(run_id)
            try:
                outcome = self.do(self.queue.cancel(run_id, actor="op"))
            except RunFinishedError:
                assert before.status in ("succeeded", "failed")
                return
            assert outcome.run.status == "cancelled"
            assert outcome.changed == (before.status != "cancelled")
            if outcome.changed:
                assert outcome.run.lease_epoch == before.lease_epoch + 1
            self.finished[run_id] = "cancelled"

        # --- invariants -------------------------------------------------------------------
        @invariant()
        def logs_and_attempts_hold(self) -> None:
            async def check() -> None:
                async with self.engine.connect() as conn:
                    for run_id in self.run_ids:
                        log = await read_log(conn, run_id)
                        check_log(log)

            self.do(check())
            for run_id in self.run_ids:
                run = self.run(run_id)
                assert run.attempts == self.attempts[run_id], run
                if run_id in self.finished:
                    assert run.status == self.finished[run_id], "a terminal status changed"
                assert (run.status == "running") == (run.lease_owner is not None)

    # One rule per kind of write, so each is drawn as often as any other rule.
    for kind in WRITES:

        def write_rule(self: QueueMachine, which: int, kind: str = kind) -> None:
            self.write(which, kind)

        write_rule.__name__ = f"write_{kind}"
        setattr(
            QueueMachine,
            write_rule.__name__,
            precondition(lambda self: bool(self.leases))(
                rule(which=st.sampled_from([0, 0, 0, 1, 1, 2, 3, 9]))(write_rule)
            ),
        )
    return QueueMachine


def test_queue_state_machine(database_url: str) -> None:
    machine = make_machine(database_url)
    machine.TestCase.settings = settings(
        max_examples=40,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()
    print("\nstate machine exercised:", dict(sorted(SEEN.items())))
    # The machine must really have met both current and stale leases for every write.
    for kind in WRITES:
        assert SEEN[f"{kind} on a current lease"] > 0, kind
    assert sum(n for k, n in SEEN.items() if "current" not in k) > 50
