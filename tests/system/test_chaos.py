"""The reliability suite: real processes, a real PostgreSQL, and things going wrong on purpose.

1. SIGKILL chaos. `serve --no-workers` and three `turnstile worker` processes with short
   leases take a mixed load over HTTP (sessionless runs of both classes, conversations whose
   turns ask the user and are answered, sleeps, unsafe and keyed POSTs to a counting server),
   while a random worker in the middle of runs is SIGKILLed and replaced, database backends are
   terminated now and then, the worker holding a "poison" run is killed every time until the
   run exhausts its attempts, and clients hammer the idempotency layer (identical submissions
   at once, retries after client timeouts, a key reused with another body).
2. Database restarts. The same roles on a throwaway cluster of the test's own (never the
   machine's server), which is shut down or crashed four times under load.

The SIGKILL chaos runs with three tenants (fair shares, docs/adr/0006): `flood` sends the
sessionless flood and the poison runs under a concurrency limit of its own, `acme` holds the
conversations and `bravo` the idempotency abuse, so every transition also moves its tenant's
counts while processes die. `acme` also holds a few sessions with a multitask policy
(enqueue, interrupt, steer: docs/turn-control.md) that take several turns while their runs
work, so interrupts, steers and pending turns meet the kills too.

Afterwards: every accepted submission has exactly one run and it is terminal; every run's log
passes the shared invariants (gap-free sequences, one epoch at a time, valid status path) and
every tenant's counts equal its running and queued runs (no drift);
no unsafe call reached the counting server twice; every unsafe call left without an outcome is
`uncertain` in the run's result; keyed calls always carried their one key; runs out of attempts
are failed with a failure; every multitask turn is accounted for exactly once (a run, the
run its pending turn became, or an input delivered to the run it steered; a cancelled run only
as `interrupted`), no pending turn is left pending, and no session ever had two non-terminal
runs (looked for during the chaos and after). The wait for the end fails only when nothing
finished for a while, and then names what was unfinished. A report is printed at the end of
the pytest session.

`TURNSTILE_CHAOS_SCALE` (default 1) multiplies the load and the chaos duration for a soak, e.g.
`TURNSTILE_CHAOS_SCALE=10 pytest tests/system/test_chaos.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.security.api_keys import create_key
from app.store.embedded import LocalCluster, free_port
from app.store.engine import create_engine
from app.store.migrate import upgrade
from tests.support.chaos import (
    REPORTS,
    TERMINAL,
    Client,
    CountingServer,
    Fleet,
    Ledger,
    Turn,
    account_turns,
    counting_server,
    examine,
    multitask_script,
    report,
    running_pids,
    session_script,
    sessionless_script,
    sessions_with_two_active_runs,
    terminate_backends,
    until_settled,
)
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.tenants import set_limits
from tests.support.waiting import eventually

SCALE = max(1, int(os.environ.get("TURNSTILE_CHAOS_SCALE", "1")))
SESSIONLESS = 2_000 * SCALE
# However fast the machine, the load goes on until the chaos has killed this many workers.
MIN_KILLS = 12 * SCALE
SESSIONS = 30 * SCALE
TURNS = 4
# Sessions with a multitask policy (docs/turn-control.md), each sent MULTITASK_TURNS turns
# while its runs work: few, so the added load stays small beside the flood.
MULTITASK_SESSIONS = 9 * SCALE
MULTITASK_TURNS = 4
POLICIES = ("enqueue", "interrupt", "steer")
POISON = 2
MAX_ATTEMPTS = 3

# Short leases so a killed worker's runs come back quickly; every interval stays consistent
# with the settings' own rules (heartbeat at most a third of the lease).
FAST = {
    "TURNSTILE_LEASE_SECONDS": "2",
    "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
    "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.25",
    "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
    "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
    "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS": "1",
    "TURNSTILE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    "TURNSTILE_DRAIN_GRACE_SECONDS": "2",
    "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    "TURNSTILE_HTTP_TIMEOUT_SECONDS": "5",
    "TURNSTILE_SLOTS": "interactive:3,async:6,maintenance:1",
    # Five processes, plus the ones just killed whose backends are still closing, must fit in
    # the server's 100 connections beside the test's own.
    "TURNSTILE_DB_POOL_SIZE": "8",
    # A killed worker holds an interrupt up for this bound plus a sweep interval at most.
    "TURNSTILE_INTERRUPT_GRACE_SECONDS": "3",
}


@dataclass
class Service:
    """The processes one test runs: an API replica, a fleet of workers, the counting server."""

    fleet: Fleet
    client: Client
    counter: CountingServer


async def start_service(
    stack: AsyncExitStack, env: dict[str, str], key: str, ledger: Ledger, *, workers: int
) -> Service:
    counter = await stack.enter_async_context(counting_server())
    port = free_port()  # only now: the counting server's port is taken
    await stack.enter_async_context(
        turnstile("serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env)
    )
    fleet = Fleet(env, stack)
    for _ in range(workers):
        await fleet.start_worker()
    client = Client(f"http://127.0.0.1:{port}", key, ledger)
    stack.push_async_callback(client.aclose)
    return Service(fleet, client, counter)


def _replays(fleet: Fleet) -> str:
    """Fenced writes and completion batches the workers replayed after a lost connection left
    their outcome unknown (docs/reliability.md, "Lost connections and replays")."""
    writes = fleet.log_count(b"fenced write of unknown outcome replayed")
    batches = fleet.log_count(b"completion batch of unknown outcome replayed")
    return f"{writes} / {batches}"


async def finished_runs(engine: AsyncEngine, ids: list[str], statuses: tuple[str, ...]) -> int:
    """How many of the runs `ids` are in one of `statuses`."""
    async with engine.connect() as conn:
        n = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM runs WHERE id = ANY(CAST(:ids AS uuid[])) "
                    "AND status = ANY(:statuses)"
                ),
                {"ids": ids, "statuses": list(statuses)},
            )
        ).scalar_one()
    return int(n)


class Load:
    """The clients of one test: submissions, conversations and idempotency abuse."""

    def __init__(self, client: Client, counter: CountingServer, ledger: Ledger) -> None:
        self.client = client
        self.counter = counter.base
        self.ledger = ledger
        self.turn_seconds: list[float] = []  # a conversation turn, submitted to finished
        self.sessionless_submitted = 0

    async def run(self, tag: str, body: dict[str, Any], key: str | None = None) -> UUID:
        response = await self.client.post("/runs", {**body}, key or tag)
        assert response.status_code == 202, (response.status_code, response.text)
        run_id = UUID(response.json()["id"])
        self.ledger.accept(tag, run_id)
        return run_id

    async def sessionless(
        self, count: int, concurrency: int = 12, more: Callable[[], bool] = lambda: False
    ) -> None:
        """At least `count` sessionless runs, and more while `more()` says so."""
        indexes = itertools.count()

        async def submitter() -> None:
            for i in indexes:
                if i >= count and not more():
                    return
                self.sessionless_submitted += 1
                tag = f"r{i}"
                body = {
                    "input": {"tag": tag, "script": sessionless_script(i, self.counter, tag)},
                    "priority": "interactive" if i % 4 == 0 else "async",
                }
                await self.run(tag, body)

        await asyncio.gather(*(submitter() for _ in range(concurrency)))

    async def poison(self, n: int) -> None:
        for p in range(n):
            tag = f"poison{p}"
            body = {
                "input": {
                    "tag": tag,
                    "poison": True,
                    "script": [{"call": "sleep", "args": {"seconds": 60}}] * 3,
                },
                "priority": "interactive",
            }
            await self.run(tag, body)

    async def conversation(self, s: int) -> None:
        response = await self.client.post("/sessions", {}, f"session-{s}")
        assert response.status_code == 201, response.text
        session = response.json()["id"]
        for turn in range(TURNS):
            tag = f"s{s}t{turn}"
            body = {"input": {"tag": tag, "script": session_script(s, turn, self.counter, tag)}}
            began = time.monotonic()
            response = await self.client.post(f"/sessions/{session}/turns", body, tag)
            assert response.status_code == 202, (response.status_code, response.text)
            run_id = UUID(response.json()["id"])
            self.ledger.accept(tag, run_id)
            answered = 0
            seen = response.json()["status"]
            while True:
                # Wait for a change from the status this client last saw, not from whatever
                # the status is when the request arrives: a change in between is not missed.
                run = (await self.client.get(f"/runs/{run_id}", wait=30, status=seen)).json()
                seen = run["status"]
                if run["status"] in TERMINAL:
                    break
                if run["status"] == "waiting_for_user":
                    answered += 1
                    answer = {"input": f"account {answered} for {tag}"}
                    response = await self.client.post(
                        f"/sessions/{session}/turns", answer, f"{tag}-answer-{answered}"
                    )
                    assert response.status_code == 202, (response.status_code, response.text)
                    # An answer goes to the waiting run itself; no new run is created.
                    assert UUID(response.json()["id"]) == run_id
                    self.ledger.answers += 1
            self.turn_seconds.append(time.monotonic() - began)

    async def multitask(self, s: int) -> None:
        """A session with a multitask policy: a first turn that works a while, then more turns
        while its runs work, each sent once the run it meets has left the queue (or after a
        long poll's bound: a turn that meets a queued run is part of the mix too)."""
        policy = POLICIES[s % len(POLICIES)]
        response = await self.client.post("/sessions", {"multitask": policy}, f"mt-session-{s}")
        assert response.status_code == 201, response.text
        session = response.json()["id"]
        for turn in range(MULTITASK_TURNS):
            tag = f"m{s}t{turn}"
            if turn:
                state = (await self.client.get(f"/sessions/{session}")).json()
                if state["active_run_id"] and state["active_run_status"] == "queued":
                    await self.client.get(
                        f"/runs/{state['active_run_id']}", wait=30, status="queued"
                    )
            body = {"input": {"tag": tag, "script": multitask_script(s, turn, self.counter, tag)}}
            response = await self.client.post(f"/sessions/{session}/turns", body, tag)
            assert response.status_code == 202, (response.status_code, response.text)
            doc = response.json()
            if "pending_turn" in doc:
                answer, turn_id, run_id = "steer", doc["pending_turn"]["id"], UUID(doc["id"])
            elif doc.get("kind") == "pending_turn":
                answer, turn_id, run_id = "pending", doc["id"], None
            else:
                answer, turn_id, run_id = "run", doc["id"], UUID(doc["id"])
            self.ledger.accept_turn(Turn(tag, session, policy, answer, UUID(turn_id), run_id))

    async def identical_at_once(self, n: int) -> None:
        """Four clients send the same submission with the same key at the same moment."""
        for k in range(n):
            tag = f"twin{k}"
            body = {"input": {"tag": tag, "script": [{"call": "echo", "args": {}}]}}
            await asyncio.gather(*(self.run(tag, body) for _ in range(4)))

    async def retried_after_timeouts(self, n: int) -> None:
        """A first attempt that gives up almost at once, then the retry with the same key."""
        for k in range(n):
            tag = f"impatient{k}"
            body = {"input": {"tag": tag, "script": [{"final": k}]}}
            response = await self.client.post("/runs", body, tag, first_timeout=0.002)
            assert response.status_code == 202, response.text
            self.ledger.accept(tag, UUID(response.json()["id"]))

    async def reused_keys(self, n: int) -> None:
        """The same key with another body is refused and creates nothing."""
        for k in range(n):
            tag = f"reuse{k}"
            await self.run(tag, {"input": {"tag": tag, "script": [{"final": 1}]}})
            other = {"input": {"tag": f"{tag}-other", "script": [{"final": 2}]}}
            response = await self.client.post("/runs", other, tag)
            assert response.status_code == 422, (response.status_code, response.text)
            assert response.json()["type"].endswith("idempotency-key-reused")
            self.ledger.key_reuse_refused += 1


async def chaos(
    engine: AsyncEngine,
    fleet: Fleet,
    done: asyncio.Event,
    rng: random.Random,
    stats: dict[str, int],
    doubled: set[str],
) -> None:
    """Until the load is finished: kill a worker in the middle of runs and start another; kill
    whoever holds a poison run; now and then terminate some database backends. Every round
    also looks for a session with two non-terminal runs (into `doubled`)."""
    round_ = 0
    pauses: list[asyncio.Task[None]] = []
    while not done.is_set():
        round_ += 1
        doubled.update(await sessions_with_two_active_runs(engine))
        # The chaos cadence: a kill every 0.6 to 1.6 s.
        with suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), rng.uniform(0.6, 1.6))
        if done.is_set():
            break
        live = set(fleet.workers) - fleet.paused  # a frozen worker must wake up to be fenced
        poisoned = await running_pids(engine, live, poison_only=True)
        busy = poisoned or await running_pids(engine, live)
        if busy:
            victim = rng.choice(busy)
            await fleet.kill(victim)
            stats["poison kills"] += bool(poisoned)
            await fleet.start_worker()
        if round_ % 3 == 0:
            stats["backends terminated"] += await terminate_backends(engine, rng, at_most=2)
        if round_ % 4 == 2 and not fleet.paused:
            # Freeze a busy worker past its lease: its runs are swept and claimed elsewhere,
            # and when it wakes up every write it attempts must be fenced off.
            frozen = await running_pids(engine, live)
            if frozen:
                # Longer than its lease and than the sweeper's own lease (5 s), so the sweep
                # goes on elsewhere even when the frozen process was the one sweeping.
                pauses.append(asyncio.create_task(fleet.pause(rng.choice(frozen), 7.0)))
    await asyncio.gather(*pauses)


# Generous: the waits inside are bounded by what the test caused (a stall fails it sooner).
@pytest.mark.timeout(1800)
async def test_sigkill_chaos_loses_nothing_and_repeats_no_unsafe_effect(
    database_url: str, engine: AsyncEngine
) -> None:
    started = time.monotonic()
    rng = random.Random(int(os.environ.get("TURNSTILE_CHAOS_SEED", "0")) or None)
    env = {"DATABASE_URL": database_url, **FAST}
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    flood_key = (await create_key(engine, tenant_id="flood", principal="svc")).secret
    bravo_key = (await create_key(engine, tenant_id="bravo", principal="svc")).secret
    # The flooding tenant runs under a concurrency limit of its own (an admin's override).
    await set_limits(engine, "flood", max_running={"interactive": 8, "async": 12})
    ledger = Ledger()
    stats = {"poison kills": 0, "backends terminated": 0}
    doubled: set[str] = set()  # sessions seen with two non-terminal runs (there must be none)
    async with AsyncExitStack() as stack:
        service = await start_service(stack, env, key, ledger, workers=3)
        fleet, counter = service.fleet, service.counter
        load = Load(service.client, counter, ledger)
        tenants: list[Load] = []
        for other in (flood_key, bravo_key):
            client = Client(str(service.client.http.base_url), other, ledger)
            stack.push_async_callback(client.aclose)
            tenants.append(Load(client, counter, ledger))
        flood, bravo = tenants

        done = asyncio.Event()
        havoc = asyncio.create_task(chaos(engine, fleet, done, rng, stats, doubled))
        try:
            await flood.poison(POISON)
            phases: dict[str, float] = {}

            async def timed(name: str, *work: Any) -> None:
                await asyncio.gather(*work)
                phases[name] = time.monotonic() - started

            await asyncio.gather(
                timed(
                    "sessionless",
                    flood.sessionless(SESSIONLESS, more=lambda: fleet.kills < MIN_KILLS),
                ),
                timed("conversations", *(load.conversation(s) for s in range(SESSIONS))),
                timed("multitask", *(load.multitask(s) for s in range(MULTITASK_SESSIONS))),
                timed(
                    "idempotency",
                    bravo.identical_at_once(20),
                    bravo.retried_after_timeouts(20),
                    bravo.reused_keys(10),
                ),
            )
            loaded = time.monotonic()
            # Every run terminal and no pending turn pending: the accepted runs, and the runs
            # the pending turns become. Poison runs need MAX_ATTEMPTS kills; the chaos goes on
            # until they are out. A timeout says what was still unfinished.
            await until_settled(
                engine, stall=180, at_most=1200, what="every run to finish, every turn to start"
            )
            finished = time.monotonic()
        finally:
            done.set()
            await havoc
        hits = await counter.hits()
        survivors = len(fleet.workers)
        self_fenced = fleet.log_count(b"self-fenced")
    # The fleet drained on SIGTERM and exited 0 (checked by `turnstile()` on the way out).

    # The multitask turns first: those that became runs join the accepted runs examined next.
    turns = await account_turns(engine, ledger)
    doubled.update(await sessions_with_two_active_runs(engine))
    found = await examine(engine, ledger, hits)
    checked = await check_all_runs(engine)
    async with engine.connect() as conn:
        poison = (
            await conn.execute(
                text(
                    "SELECT status, attempts, failure->>'kind' AS kind FROM runs "
                    "WHERE input->>'poison' = 'true'"
                )
            )
        ).all()
    REPORTS.append(
        report(
            f"SIGKILL chaos (scale {SCALE}, {time.monotonic() - started:.0f} s)",
            {
                "submissions accepted": len(ledger.accepted),
                "runs in the database": found.runs,
                "statuses": dict(found.statuses),
                "answers delivered": ledger.answers,
                "multitask turns (by policy)": f"{len(ledger.turns)} ({dict(turns.by_policy)})",
                "  ran / interrupted / steered into a run": (
                    f"{turns.ran} / {turns.interrupted} / {turns.steered}"
                ),
                "  answered as run / pending / steer": dict(
                    Counter(t.answer for t in ledger.turns.values())
                ),
                "turn duration p50 / max (s)": (
                    f"{statistics.median(load.turn_seconds):.1f} / {max(load.turn_seconds):.1f}"
                ),
                "claims": found.claims,
                "requeued by the sweeper": found.requeued,
                "released early": found.released,
                "fenced writes recorded / self-fenced runs": f"{found.fenced} / {self_fenced}",
                "dead-lettered (attempts)": found.dead_lettered_by_attempts,
                "unsafe calls / uncertain / ambiguous": (
                    f"{found.unsafe_calls} / {found.uncertain} / {found.ambiguous}"
                ),
                "keyed calls / repeated with same key": (
                    f"{found.keyed_calls} / {found.keyed_repeats}"
                ),
                "workers SIGKILLed (poison holders)": f"{fleet.kills} ({stats['poison kills']})",
                "workers frozen past their lease": fleet.pauses,
                "submitting / finishing (s)": f"{loaded - started:.0f} / {finished - loaded:.0f}",
                "load finished at (s)": ", ".join(f"{k} {v:.0f}" for k, v in phases.items()),
                "backends terminated": stats["backends terminated"],
                "writes / completion batches replayed": _replays(fleet),
                "client retries / replays / reuse refused": (
                    f"{ledger.retries} / {ledger.replayed} / {ledger.key_reuse_refused}"
                ),
                "duplicate unsafe effects": found.duplicate_unsafe_effects,
                "invariant-checked runs": checked,
            },
        )
    )
    assert found.problems == [], found.problems[:20]
    assert found.duplicate_unsafe_effects == 0
    assert checked == len(ledger.accepted)
    # Every multitask turn accounted for exactly once; none left pending; never two active
    # runs in a session, during the chaos or after it.
    assert turns.problems == [], turns.problems[:20]
    assert len(ledger.turns) == MULTITASK_SESSIONS * MULTITASK_TURNS
    assert turns.ran + turns.interrupted + turns.steered == len(ledger.turns)
    assert turns.pending_left == 0
    assert doubled == set(), sorted(doubled)[:5]
    expected = (
        flood.sessionless_submitted + SESSIONS * TURNS + POISON + 20 + 20 + 10 + turns.became_runs
    )
    assert len(ledger.accepted) == expected
    # The chaos really happened: workers died mid-run and their runs came back.
    assert fleet.kills >= MIN_KILLS, fleet.kills
    assert stats["backends terminated"] >= 1
    assert flood.sessionless_submitted >= SESSIONLESS
    assert found.requeued > 0
    assert survivors == 3
    # A worker frozen past its lease woke up to find its runs gone, and wrote nothing more for
    # them: either the database refused a write (run.fenced) or its own clock stopped it first.
    assert fleet.pauses >= 1
    assert found.fenced + self_fenced >= 1
    # Poison runs were killed on every attempt and ended in the dead letter, not lost.
    assert [(p.status, p.attempts, p.kind) for p in poison] == [
        ("failed", MAX_ATTEMPTS, "lease_expired")
    ] * POISON
    assert ledger.key_reuse_refused == 10


@pytest.mark.timeout(600)
async def test_database_restarts_under_load_lose_no_accepted_turn(
    throwaway_cluster: LocalCluster,
) -> None:
    started = time.monotonic()
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(Settings(), url)
    ledger = Ledger()
    restarts: list[str] = []
    try:
        key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
        env = {"DATABASE_URL": url, **FAST, "TURNSTILE_MAX_ATTEMPTS": "10"}
        async with AsyncExitStack() as stack:
            service = await start_service(stack, env, key, ledger, workers=2)
            counter = service.counter
            load = Load(service.client, counter, ledger)

            async def faults() -> None:
                # Wait for work in flight, then take the database away: a fast shutdown that
                # disconnects everyone, or an immediate one (a crash: WAL recovery on start).
                for mode in ("fast", "immediate", "immediate", "fast"):

                    async def busy() -> bool:
                        return len(ledger.accepted) >= 60 * (len(restarts) + 1)

                    await eventually(busy, within=120, what="submissions before a restart")
                    await asyncio.to_thread(throwaway_cluster.stop, mode)
                    restarts.append(mode)
                    await asyncio.to_thread(throwaway_cluster.start)

            await asyncio.gather(
                faults(),
                load.sessionless(400, concurrency=6),
                *(load.conversation(s) for s in range(10)),
            )
            accepted = [str(run_id) for run_id in ledger.accepted.values()]

            async def all_terminal() -> bool:
                try:
                    succeeded = await finished_runs(engine, accepted, ("succeeded",))
                except OSError:
                    return False
                return succeeded == len(accepted)

            await eventually(all_terminal, within=240, what="every accepted run to succeed")
            hits = await counter.hits()
        found = await examine(engine, ledger, hits)
        checked = await check_all_runs(engine)
        REPORTS.append(
            report(
                f"Database restarts ({time.monotonic() - started:.0f} s)",
                {
                    "restarts": ", ".join(restarts),
                    "submissions accepted": len(ledger.accepted),
                    "statuses": dict(found.statuses),
                    "client retries": ledger.retries,
                    "requeued / released / fenced": (
                        f"{found.requeued} / {found.released} / {found.fenced}"
                    ),
                    "unsafe calls / uncertain": f"{found.unsafe_calls} / {found.uncertain}",
                    "writes / completion batches replayed": _replays(service.fleet),
                    "duplicate unsafe effects": found.duplicate_unsafe_effects,
                    "invariant-checked runs": checked,
                },
            )
        )
        assert found.problems == [], found.problems[:20]
        assert len(restarts) == 4
        assert len(ledger.accepted) == 400 + 10 * TURNS
        assert found.statuses == {"succeeded": len(ledger.accepted)}
        assert checked == len(ledger.accepted)
    finally:
        await engine.dispose()


async def test_a_frozen_worker_wakes_up_fenced(database_url: str, engine: AsyncEngine) -> None:
    """SIGSTOP the worker in the middle of a run for longer than its lease, SIGCONT it after
    another worker has taken the run over: the sleeper must not write for that run again."""
    env = {"DATABASE_URL": database_url, **FAST}
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    async with AsyncExitStack() as stack:
        service = await start_service(stack, env, key, Ledger(), workers=2)
        fleet, client = service.fleet, service.client
        script = [{"call": "sleep", "args": {"seconds": 0.5}} for _ in range(8)]
        response = await client.post("/runs", {"input": {"tag": "t", "script": script}}, "t")
        run_id = UUID(response.json()["id"])

        async def holder() -> int | None:
            pids = await running_pids(engine, set(fleet.workers))
            return pids[0] if pids else None

        first = await eventually(holder, within=30, what="the run to be claimed")

        async def taken_over() -> bool:
            async with engine.connect() as conn:
                n = (
                    await conn.execute(
                        text("SELECT lease_epoch FROM runs WHERE id = :id"), {"id": run_id}
                    )
                ).scalar_one()
            return bool(n >= 2)

        async def row_lockable() -> bool:
            """False while a transaction holds the run's row (NOWAIT answers at once)."""
            async with engine.connect() as conn:
                await conn.begin()
                try:
                    await conn.execute(
                        text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE NOWAIT"), {"id": run_id}
                    )
                except DBAPIError:
                    return False
                finally:
                    await conn.rollback()
            return True

        # Frozen until another worker has claimed the run: past the run's lease (2 s) and, when
        # the frozen process was the one sweeping, past the sweeper's own lease (5 s) too. A
        # fixed freeze could end first on a busy machine, and the sleeper claim the run again.
        # A process frozen inside a transaction on the run's row (a heartbeat, a journal write)
        # holds its lock until the server's idle-in-transaction timeout, and the sweeper skips
        # locked rows: that freeze is thawed and tried again, so the test waits for a takeover
        # that can happen now.
        for _ in range(20):
            async with fleet.frozen(first):
                if await row_lockable():
                    await eventually(taken_over, within=60, what="another worker to claim the run")
                    break
            await eventually(row_lockable, within=30, what="the thawed worker's transaction")
        else:
            raise AssertionError("the worker was frozen inside a transaction every time")

        async def finished() -> bool:
            run = (await client.get(f"/runs/{run_id}")).json()
            return bool(run["status"] == "succeeded")

        await eventually(finished, within=120, what="the run to finish")
        sleeper = fleet.workers[first]

        async def sleeper_stopped() -> bool:
            # Before SIGTERM: the woken worker must have met its fence on its own, not be
            # drained before it looked.
            async with engine.connect() as conn:
                fenced = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM run_events "
                            "WHERE run_id = :id AND type = 'run.fenced'"
                        ),
                        {"id": run_id},
                    )
                ).scalar_one()
            return bool(fenced) or b"self-fenced" in sleeper.log

        # Generous: on a loaded machine the woken process may get little CPU for a while.
        await eventually(sleeper_stopped, within=120, what="the woken worker to stop for the run")
    async with engine.connect() as conn:
        events = (
            await conn.execute(
                text("SELECT type, epoch, data FROM run_events WHERE run_id = :id ORDER BY seq"),
                {"id": run_id},
            )
        ).all()
    claims = [(e.epoch, e.data["owner"]) for e in events if e.type == "run.claimed"]
    fenced = [
        (e.epoch, e.data["owner"], e.data["current_epoch"])
        for e in events
        if e.type == "run.fenced"
    ]
    assert len(claims) == 2, claims
    assert claims[0][1] != claims[1][1], claims
    # The sleeper woke and wrote nothing more for the run: either the database refused its
    # write (run.fenced with its stale epoch) or its own clock stopped it before the next step.
    assert fenced == [(1, claims[0][1], 2)] or (fenced == [] and b"self-fenced" in sleeper.log)
    # Every write after the second claim is the second worker's (epoch 2).
    assert await check_all_runs(engine) == 1


async def test_a_mass_expiry_on_the_last_attempt_dead_letters_every_run(
    database_url: str, engine: AsyncEngine
) -> None:
    """Hundreds of runs on their last attempt, every worker SIGKILLed at once, the leases
    expiring together: the sweeper dead-letters them all, each with its failure and event. A
    notification naming every swept run used to exceed PostgreSQL's payload limit and roll the
    sweep back, tick after tick, leaving them all `running` for good."""
    count = 300 * SCALE
    env = {
        "DATABASE_URL": database_url,
        **FAST,
        "TURNSTILE_MAX_ATTEMPTS": "1",  # the first claim is the last attempt
        # Long enough that a busy machine never loses one of 300 leases before the kill.
        "TURNSTILE_LEASE_SECONDS": "10",
        "TURNSTILE_HEARTBEAT_SECONDS": "2",
        "TURNSTILE_SLOTS": f"interactive:1,async:{count // 2 + 10},maintenance:1",
    }
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    ledger = Ledger()
    async with AsyncExitStack() as stack:
        service = await start_service(stack, env, key, ledger, workers=2)
        load = Load(service.client, service.counter, ledger)
        ids: list[str] = []

        async def submit(i: int) -> None:
            script = [{"call": "sleep", "args": {"seconds": 60}}] * 10
            body = {"input": {"tag": f"m{i}", "script": script}}
            ids.append(str(await load.run(f"m{i}", body)))

        for start in range(0, count, 50):
            await asyncio.gather(*(submit(i) for i in range(start, min(count, start + 50))))

        async def all_running() -> bool:
            return await finished_runs(engine, ids, ("running",)) == count

        await eventually(all_running, within=120, what="every run claimed by the two workers")
        began = time.monotonic()
        for pid in list(service.fleet.workers):
            await service.fleet.kill(pid)
        await service.fleet.start_worker()  # the one that will sweep (and finds nothing to run)

        async def all_failed() -> bool:
            return await finished_runs(engine, ids, ("failed",)) == count

        await eventually(all_failed, within=90, what="every run dead-lettered")
        swept_in = time.monotonic() - began
    async with engine.connect() as conn:
        kinds = (
            await conn.execute(
                text(
                    "SELECT failure->>'kind', count(*) FROM runs WHERE status = 'failed' GROUP BY 1"
                )
            )
        ).all()
        failed_events = (
            await conn.execute(text("SELECT count(*) FROM run_events WHERE type = 'run.failed'"))
        ).scalar_one()
    assert [(kind, int(n)) for kind, n in kinds] == [("lease_expired", count)]
    assert failed_events == count
    assert await check_all_runs(engine) == count
    REPORTS.append(
        f"mass expiry: {count} runs on their last attempt, 2 workers SIGKILLed at once; "
        f"all dead-lettered {swept_in:.1f} s after the kill (lease 10 s, sweeper lease 5 s)"
    )
